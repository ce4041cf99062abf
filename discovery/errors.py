"""The errors ``discovery`` raises on purpose, at the bottom so that every module can raise them.

Why a module of their own: the value types (:mod:`discovery.base`), the election interface
(:mod:`discovery.election`) and every backend raise them, and none of those should import another
just for an exception class.
"""

from __future__ import annotations

__all__ = ["ElectionError", "RegistryError", "RegistryUnavailableError", "RegistryUnsupportedError"]


class RegistryError(Exception):
    """Base class of the errors ``discovery`` raises on purpose."""


class RegistryUnavailableError(RegistryError, ConnectionError):
    """The registry could not be reached within the allowed time.

    Raised to *students* (``watch``, one-shot reads) so that a wrong address fails loudly instead
    of looking like "no teachers". Teachers never see it: registration retries in the background.
    """


class RegistryUnsupportedError(RegistryError, ValueError):
    """The registry's backend cannot do what was asked: a static teacher list keeps no loads, no
    demand and no shared state to elect a leader in.

    A ``ValueError`` too, so that command-line front ends report it like any other bad option.
    """


class ElectionError(RegistryUnsupportedError):
    """The leader election was used wrongly (for example, on a registry that is not etcd).

    A ``ValueError`` too, so that command-line front ends report it like any other bad option.
    """
