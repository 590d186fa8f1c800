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


# -- Mooncake Store errors: codes are the original's ``mooncake::ErrorCode`` values ------------

class StoreError(MooncakeError):
    """Base of the store's errors; ``code`` is the original's ErrorCode value."""

    code = -1


class NoAvailableSpace(StoreError, MemoryError):
    """No segment has room for the object, even after eviction (NO_AVAILABLE_HANDLE)."""

    code = -200


class StoreSegmentNotFound(StoreError, LookupError):
    """No mounted segment can take a replica, or the named one is unknown (SEGMENT_NOT_FOUND)."""

    code = -101


class SegmentAlreadyExists(StoreError):
    """That segment is mounted already (SEGMENT_ALREADY_EXISTS)."""

    code = -102


class ClientNotFound(StoreError, LookupError):
    """The master does not know this client (expired, or a new leader): remount (CLIENT_NOT_FOUND)."""

    code = -103


class InvalidKey(StoreError, ValueError):
    """Empty, oversized or non-UTF-8 key (INVALID_KEY)."""

    code = -400


class InvalidParams(StoreError, ValueError):
    """A size, count or config value is out of range (INVALID_PARAMS)."""

    code = -600


class ReplicaNotReady(StoreError):
    """The object is still being written (REPLICA_IS_NOT_READY)."""

    code = -703


class ObjectNotFound(StoreError, KeyError):
    """No complete object under that key (OBJECT_NOT_FOUND)."""

    code = -704
    __str__ = Exception.__str__  # not KeyError's repr of the message


class ObjectAlreadyExists(StoreError):
    """The key exists already; use upsert to replace it (OBJECT_ALREADY_EXISTS)."""

    code = -705


class ObjectHasLease(StoreError):
    """A reader holds a lease on the object; retry later or force (OBJECT_HAS_LEASE)."""

    code = -706


class LeaseExpired(StoreError):
    """The read lease ran out before the data arrived; the bytes are not trusted (LEASE_EXPIRED)."""

    code = -707


class StoreTransferFailed(StoreError):
    """Moving the object's bytes failed on every replica (TRANSFER_FAIL)."""

    code = -800


class BufferTooSmall(StoreError, ValueError):
    """The caller's buffer is smaller than the object (BUFFER_OVERFLOW)."""

    code = -10


class RpcFailed(StoreError, OSError):
    """The master could not be reached or answered badly (RPC_FAIL)."""

    code = -900


class RpcTimeout(RpcFailed, TimeoutError):
    """The master did not answer before the deadline (RPC_TIMEOUT)."""

    code = -901


class NotSupported(StoreError):
    """The operation or option is not supported in this mode (NOT_SUPPORTED)."""

    code = -1012


class UnavailableInCurrentStatus(StoreError):
    """The target is not in a state that allows this now, e.g. a draining segment."""

    code = -1010


class TaskNotFound(StoreError, LookupError):
    """No copy/move task has this id (TASK_NOT_FOUND)."""

    code = -1400


class TaskLimitExceeded(StoreError):
    """Too many tasks are waiting (TASK_PENDING_LIMIT_EXCEEDED)."""

    code = -1401


class JobNotFound(StoreError, LookupError):
    """No drain job has this id (JOB_NOT_FOUND)."""

    code = -1402


STORE_ERRORS: dict[int, type[StoreError]] = {
    cls.code: cls
    for cls in (NoAvailableSpace, StoreSegmentNotFound, SegmentAlreadyExists, ClientNotFound,
                InvalidKey, InvalidParams, ReplicaNotReady, ObjectNotFound, ObjectAlreadyExists,
                ObjectHasLease, LeaseExpired, StoreTransferFailed, BufferTooSmall, RpcFailed,
                RpcTimeout, NotSupported, UnavailableInCurrentStatus, TaskNotFound,
                TaskLimitExceeded, JobNotFound)
}


def store_error(code: int, message: str) -> StoreError:
    """Build the store exception for an original ErrorCode received over RPC."""
    return STORE_ERRORS.get(code, StoreError)(message)
