"""etcd security options as every command spells them: TLS files and user, password from the environment.

The password never travels on a command line (anyone on the host can read argv through `ps`):
it is read from `DISTILL_REGISTRY_PASSWORD`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PASSWORD_ENV = "DISTILL_REGISTRY_PASSWORD"


def etcd_options(ca_cert: str | None = None, cert: str | None = None, key: str | None = None,
                 user: str | None = None) -> dict[str, Any]:
    """Keyword arguments for EtcdRegistry / open_registry; clear errors for half-given pairs."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both the certificate and its key (--*-cert and --*-key)")
    for label, path in (("CA certificate", ca_cert), ("client certificate", cert), ("client key", key)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{label} {path} does not exist")
    password = os.environ.get(PASSWORD_ENV)
    if user is not None and not password:
        raise ValueError(f"etcd user {user!r} given but {PASSWORD_ENV} is not set; export the password there")
    options: dict[str, Any] = {}
    if ca_cert:
        options["ca_cert"] = ca_cert
    if cert:
        options["cert_cert"], options["cert_key"] = cert, key
    if user:
        options["username"], options["password"] = user, password
    return options
