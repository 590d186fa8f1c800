"""One exception tree for the whole package, mapped to and from the original's negative codes.

The original Mooncake returns ``0`` on success and a negative ``int`` on failure; our
Pythonic API raises the exceptions below instead, and ``compat/`` turns them back into
codes with :func:`to_code`.
"""

from __future__ import annotations


class MooncakeError(Exception):
    """Base class of every error raised by mooncake_plugins."""

    code: int = -1


class InvalidArgument(MooncakeError, ValueError):
    """A caller passed a bad value (size, address, name, URL, ...)."""

    code = -1


class TransportUnavailable(MooncakeError, RuntimeError):
    """A transport cannot be used on this machine (missing library, device or peer support)."""

    code = -2


class MetadataError(MooncakeError, OSError):
    """The metadata service could not be reached or returned something unusable."""

    code = -3


class SegmentNotFound(MetadataError, LookupError):
    """No segment descriptor is published under that name."""

    code = -4


class AddressError(MooncakeError, ValueError):
    """An address range is not inside a registered region (local or remote)."""

    code = -5


class RegionBusy(MooncakeError, BufferError):
    """A region cannot be unregistered or freed while transfers or exports are outstanding."""

    code = -6


class ProtocolError(MooncakeError, ValueError):
    """A wire frame failed validation; the connection that carried it is closed."""

    code = -7


class TransferError(MooncakeError, OSError):
    """A transfer failed: the peer refused it, died, or every path to it failed."""

    code = -8


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete before its deadline."""

    code = -9


_BY_CODE: dict[int, type[MooncakeError]] = {
    cls.code: cls
    for cls in (InvalidArgument, TransportUnavailable, MetadataError, SegmentNotFound,
                AddressError, RegionBusy, ProtocolError, TransferError, TransferTimeout)
}


def to_code(exc: BaseException) -> int:
    """Return the negative code the original would have returned for ``exc``."""
    return exc.code if isinstance(exc, MooncakeError) else -1


def from_code(code: int, message: str) -> MooncakeError:
    """Build the exception for a negative ``code`` received from a peer."""
    return _BY_CODE.get(code, TransferError)(message)
