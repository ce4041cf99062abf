"""The --distill_* flags read back into a reader's keyword arguments, with the rules between flags.

``distill.flags`` adds the flags and ``distill.options.ReaderOptions`` declares them; this module
reads a parsed namespace back through those declarations (``distill.declare.read_flags``) and
applies the rules that involve several flags, whose messages name the flags to pass or fix (the
same rules for keywords are ``ReaderOptions``' own). It takes the options class as an argument so
that ``ReaderOptions.from_args`` can use it from below.
"""

from __future__ import annotations

import argparse
from typing import Any

from distill.declare import read_flags

__all__ = ["read_back"]


def read_back(options: type, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``DistillReader`` from the flags ``add_distill_args`` added (`options`:
    the class that declares them, ``ReaderOptions``).

    One key per option that has a flag (``hedge_after`` from ``--distill_hedge_ms``: "auto" when
    absent, None when 0; ``headers`` from ``--distill_header``, values from the environment where
    the flag gave none; ``registry_options`` from ``--distill_registry_*``), and ``cache`` /
    ``cache_mode`` only when ``--distill_cache`` is given. Each flag's value is checked again by its
    rule (a script may build the namespace itself); the rules between flags raise ``ValueError``
    naming the flag to pass or fix.
    """
    out = read_flags(options, args)
    teachers, registry, service = out["teachers"], out["registry"], out["service"]
    offline = out["cache"] is not None and out["cache_mode"] == "read"
    if teachers is None and registry is None and not offline:
        raise ValueError(
            "no teachers configured: pass --distill_teachers host:port[,host:port] for a fixed set of "
            "teachers, or --distill_registry etcd://host:2379 with --distill_service NAME to find them "
            "in the registry"
        )
    if teachers is not None and registry is not None:
        raise ValueError(
            "pass only one of --distill_teachers (a fixed set) and --distill_registry (discovery), not both"
        )
    if teachers is not None and service is not None:
        raise ValueError(
            "--distill_service applies only with --distill_registry; drop it when using --distill_teachers"
        )
    if registry is not None and service is None:
        raise ValueError(
            "--distill_registry needs --distill_service NAME, the service the teachers register under"
        )
    hedge, timeout = out["hedge_after"], out["timeout"]
    if isinstance(hedge, float) and hedge >= timeout:
        raise ValueError(
            f"--distill_hedge_ms {hedge * 1000:g} is not shorter than --distill_timeout {timeout:g} s, "
            "so a hedge would never be sent before the chunk is re-routed anyway; "
            "note that the hedge flag is in milliseconds"
        )
    if out["cache"] is None:  # the store's keys appear only with --distill_cache
        del out["cache"], out["cache_mode"]
    return out
