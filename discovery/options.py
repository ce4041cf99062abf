"""etcd security options as every command spells them: TLS files and user, password from the environment.

The password never travels on a command line (anyone on the host can read argv through `ps`):
it is read from `DISTILL_REGISTRY_PASSWORD`.
"""

from __future__ import annotations

import argparse
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


def add_registry_security_args(group: argparse._ActionsContainer) -> None:
    """The etcd TLS and user flags, the same on every command (teacher-server, distill-autoscaler,
    distill top); read them back with :func:`registry_security_options`."""
    group.add_argument("--registry-ca-cert", default=None, metavar="FILE", help="CA certificate for etcd over TLS")
    group.add_argument("--registry-cert", default=None, metavar="FILE",
                       help="client certificate for etcd (with --registry-key)")
    group.add_argument("--registry-key", default=None, metavar="FILE",
                       help="client key for etcd (with --registry-cert)")
    group.add_argument("--registry-user", default=None, metavar="USER",
                       help=f"etcd user; the password comes from ${PASSWORD_ENV}")


def registry_security_options(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`etcd_options` from the flags :func:`add_registry_security_args` added."""
    return etcd_options(args.registry_ca_cert, args.registry_cert, args.registry_key, args.registry_user)
