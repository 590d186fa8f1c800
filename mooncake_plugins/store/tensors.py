"""Tensor objects in the store: the original's binary layout ``[header | data]``.

A stored tensor is a 304-byte header followed by its elements in C order, byte for byte
what the original Mooncake writes, so objects move between the two implementations:

* object header (40 bytes): magic ``"NOOM"``, version, header size, dtype code, ndim,
  layout kind (full or shard), flags, data offset, data bytes;
* layout (264 bytes): global and local shape (8 dims each, unused ones ``-1``), the
  count of parallel axes, and up to 4 axes (kind, index, rank, count, split dim, two
  reserved fields).

Pure functions over torch tensors and buffers; torch is imported on first use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Sequence

from ..errors import InvalidParams, NotSupported

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
MAX_NBYTES = (1 << 63) - 1
"""Bound on the bytes a shape spans (its zero dims taken as 1): larger ones overflow the
strides of numpy and torch, so no real tensor has one."""

_HEAD = struct.Struct("<IHHiiIIQQ")         # object header: 40 bytes
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")     # one shape: 64 bytes
_COUNT = struct.Struct("<II")               # axis count + reserved
_AXIS = struct.Struct("<6iq")               # one layout axis: 32 bytes
HEADER_SIZE = _HEAD.size + 2 * _SHAPE.size + _COUNT.size + MAX_AXES * _AXIS.size
assert HEADER_SIZE == 304


class Dtype(IntEnum):
    """Element type codes of the layout."""

    FLOAT32 = 0
    FLOAT64 = 1
    INT8 = 2
    UINT8 = 3
    INT16 = 4
    UINT16 = 5
    INT32 = 6
    UINT32 = 7
    INT64 = 8
    UINT64 = 9
    BOOL = 10
    FLOAT16 = 11
    BFLOAT16 = 12
    FLOAT8_E4M3 = 13
    FLOAT8_E5M2 = 14


_CODES = frozenset(Dtype)
_TORCH_NAMES = {Dtype.FLOAT8_E4M3: "float8_e4m3fn", Dtype.FLOAT8_E5M2: "float8_e5m2"}
_ITEMSIZE = {Dtype.FLOAT64: 8, Dtype.INT64: 8, Dtype.UINT64: 8, Dtype.FLOAT32: 4,
             Dtype.INT32: 4, Dtype.UINT32: 4, Dtype.INT16: 2, Dtype.UINT16: 2,
             Dtype.FLOAT16: 2, Dtype.BFLOAT16: 2}  # the rest: 1 byte


class Layout(IntEnum):
    FULL = 0
    SHARD = 1


class AxisKind(IntEnum):
    """Kinds of parallel axes (``"dp"``, ``"tp"``, ...)."""

    DP = 0
    TP = 1
    EP = 2
    PP = 3
    RESERVED = 4


@dataclass
class Axis:
    """One parallel axis of a shard: this shard is ``rank`` of ``count`` along ``split_dim``
    (-1: replicated along this axis). ``tag`` is the expert or stage id; ``extent`` the
    local size along ``split_dim``."""

    kind: int
    index: int
    rank: int
    count: int
    split_dim: int = -1
    tag: int = 0
    extent: int = 0


@dataclass
class TensorHeader:
    """The decoded header of one stored tensor."""

    dtype: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layout: int = Layout.FULL
    axes: list[Axis] = field(default_factory=list)
    data_bytes: int = 0

    @property
    def ndim(self) -> int:
        return len(self.local_shape)

    def expected_bytes(self) -> int:
        n = itemsize(self.dtype)
        for d in self.local_shape:
            n *= d
        return n


def torch() -> Any:
    """The torch module, or NotSupported naming what is missing."""
    try:
        import torch as _torch
    except ImportError as exc:
        raise NotSupported("tensor operations need PyTorch (pip install torch)") from exc
    return _torch


def itemsize(code: int) -> int:
    return _ITEMSIZE.get(Dtype(code), 1)


def dtype_code(dtype: Any) -> int:
    """The layout's code of a torch dtype; InvalidParams for one it cannot store."""
    name = str(dtype).removeprefix("torch.")
    for code in Dtype:
        if _TORCH_NAMES.get(code, code.name.lower()) == name:
            return int(code)
    raise InvalidParams(f"unsupported tensor dtype {dtype}")


def check_shape(shape: Sequence[int], dtype: int, what: str = "tensor") -> None:
    """InvalidParams unless ``dtype`` is a layout code and ``shape`` a shape of it that
    numpy and torch can hold (stored fields come from other processes)."""
    if dtype not in _CODES:
        raise InvalidParams(f"{what} has no dtype {dtype}")
    span = itemsize(dtype)
    for d in shape:
        if d < 0:
            raise InvalidParams(f"{what} has a negative dim: {tuple(shape)}")
        span *= max(d, 1)
    if span > MAX_NBYTES:
        raise InvalidParams(f"{what} shape {tuple(shape)} spans more than {MAX_NBYTES} bytes")


def torch_dtype(code: int) -> Any:
    c = Dtype(code)
    return getattr(torch(), _TORCH_NAMES.get(c, c.name.lower()))


# -- header ---------------------------------------------------------------------------------
def _shape(dims: Sequence[int]) -> bytes:
    return _SHAPE.pack(*dims, *([-1] * (MAX_DIMS - len(dims))))


def pack_header(h: TensorHeader) -> bytes:
    """The 304 header bytes of ``h``."""
    if h.ndim > MAX_DIMS or len(h.global_shape) != h.ndim:
        raise InvalidParams(f"tensors of {h.ndim} dims cannot be stored (at most {MAX_DIMS})")
    if len(h.axes) > MAX_AXES:
        raise InvalidParams(f"at most {MAX_AXES} parallel axes")
    out = bytearray(HEADER_SIZE)
    _HEAD.pack_into(out, 0, MAGIC, VERSION, HEADER_SIZE, h.dtype, h.ndim, h.layout, 0,
                    HEADER_SIZE, h.data_bytes)
    off = _HEAD.size
    out[off:off + _SHAPE.size] = _shape(h.global_shape)
    out[off + _SHAPE.size:off + 2 * _SHAPE.size] = _shape(h.local_shape)
    off += 2 * _SHAPE.size
    _COUNT.pack_into(out, off, len(h.axes), 0)
    off += _COUNT.size
    for a in h.axes:
        _AXIS.pack_into(out, off, a.kind, a.index, a.rank, a.count, a.split_dim, a.tag, a.extent)
        off += _AXIS.size
    return bytes(out)


def parse_header(buf: Any, total: int | None = None) -> TensorHeader:
    """Decode and check the header at the start of ``buf`` (an object of ``total`` bytes,
    default ``len(buf)``); InvalidParams when it is not a well-formed tensor object."""
    mv = memoryview(buf).cast("B")
    total = mv.nbytes if total is None else total
    if total < HEADER_SIZE or mv.nbytes < HEADER_SIZE:
        raise InvalidParams(f"{total} bytes cannot hold a tensor header ({HEADER_SIZE})")
    magic, version, hsize, dtype, ndim, layout, _, offset, nbytes = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or hsize != HEADER_SIZE:
        raise InvalidParams("not a tensor object (bad magic, version or header size)")
    if not 0 <= ndim <= MAX_DIMS or layout > Layout.SHARD:
        raise InvalidParams("tensor header has a bad ndim or layout kind")
    if offset != HEADER_SIZE or nbytes != total - offset:
        raise InvalidParams(f"tensor header says {nbytes} data bytes at {offset}; "
                            f"the object has {total} bytes")
    off = _HEAD.size
    gshape = _SHAPE.unpack_from(mv, off)
    lshape = _SHAPE.unpack_from(mv, off + _SHAPE.size)
    if any(d != -1 for d in gshape[ndim:] + lshape[ndim:]):
        raise InvalidParams("tensor header has dims past its ndim")
    check_shape(gshape[:ndim], dtype, "tensor header's global")
    check_shape(lshape[:ndim], dtype, "tensor header's local")
    off += 2 * _SHAPE.size
    count, _ = _COUNT.unpack_from(mv, off)
    if count > MAX_AXES:
        raise InvalidParams("tensor header has too many parallel axes")
    off += _COUNT.size
    axes = []
    for i in range(count):
        a = Axis(*_AXIS.unpack_from(mv, off + i * _AXIS.size))
        if not (AxisKind.DP <= a.kind <= AxisKind.RESERVED and 0 <= a.rank < a.count
                and -1 <= a.split_dim < ndim):
            raise InvalidParams("tensor header has a bad parallel axis")
        axes.append(a)
    h = TensorHeader(dtype, gshape[:ndim], lshape[:ndim], layout, axes, nbytes)
    if h.expected_bytes() != nbytes:
        raise InvalidParams(f"tensor header: shape {h.local_shape} does not make {nbytes} bytes")
    return h


# -- tensors --------------------------------------------------------------------------------
def header_of(tensor: Any, global_shape: Sequence[int] | None = None,
              axes: Sequence[Axis] = ()) -> TensorHeader:
    """The header describing ``tensor`` (a shard of ``global_shape`` when ``axes`` are given)."""
    shape = tuple(int(d) for d in tensor.shape)
    return TensorHeader(dtype_code(tensor.dtype), tuple(global_shape or shape), shape,
                        Layout.SHARD if axes else Layout.FULL, list(axes),
                        tensor.numel() * tensor.element_size())


def encode(tensor: Any, header: TensorHeader | None = None) -> bytearray:
    """``[header | data]`` of ``tensor`` in one new buffer: the elements are copied once,
    straight from any strided view or device."""
    if not hasattr(tensor, "dtype") or not hasattr(tensor, "element_size"):
        raise InvalidParams(f"expected a torch tensor, got {type(tensor).__name__}")
    header = header or header_of(tensor)
    out = bytearray(HEADER_SIZE + header.data_bytes)
    out[:HEADER_SIZE] = pack_header(header)
    if header.data_bytes:
        t = torch()
        dst = t.frombuffer(out, dtype=t.uint8, offset=HEADER_SIZE)
        dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return out


def encode_parts(tensor: Any, header: TensorHeader | None = None) -> list[Any]:
    """``[header, data]`` of ``tensor`` for a gathered put (``batch_put_parts``): the data
    part is the tensor's own memory when it is a contiguous CPU tensor, so the elements are
    copied once, into the segment; any other tensor is :func:`encode`-d (one copy here)."""
    if not hasattr(tensor, "dtype") or not hasattr(tensor, "element_size"):
        raise InvalidParams(f"expected a torch tensor, got {type(tensor).__name__}")
    header = header or header_of(tensor)
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() \
            or header.data_bytes == 0:
        return [encode(tensor, header)]
    return [pack_header(header), t.reshape(-1).view(torch().uint8).numpy()]


def decode(buf: Any, total: int | None = None, copy: bool = True) -> Any:
    """The tensor in a ``[header | data]`` object. ``copy=False`` returns a tensor over
    ``buf``'s memory (it must be writable), as ``get_tensor_into`` does."""
    mv = memoryview(buf).cast("B")
    h = parse_header(mv, total)
    t = torch()
    dtype = torch_dtype(h.dtype)
    if h.data_bytes == 0:
        return t.empty(h.local_shape, dtype=dtype)
    data = mv[HEADER_SIZE:HEADER_SIZE + h.data_bytes]
    if copy:
        out = t.empty(h.local_shape, dtype=dtype)
        out.reshape(-1).view(t.uint8).numpy()[:] = data
        return out
    if data.readonly:
        raise InvalidParams("decode(copy=False) needs writable memory")
    return t.frombuffer(data, dtype=t.uint8).view(dtype).reshape(h.local_shape)


class _CudaBytes:
    """``nbytes`` of GPU memory at ``address``, as CUDA's array interface describes it (what
    ``torch.as_tensor`` wraps without a copy)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "strides": None,
                                         "version": 3}


def decode_device(address: int, total: int, device: int) -> Any:
    """The tensor in a ``[header | data]`` object held in GPU memory at ``address``: a CUDA
    tensor over that memory (no copy; the header is read through a CUDA copy)."""
    from ..transfer import memory

    h = parse_header(memory.read_bytes(address, HEADER_SIZE), total)
    t = torch()
    dtype = torch_dtype(h.dtype)
    if h.data_bytes == 0:
        return t.empty(h.local_shape, dtype=dtype, device=f"cuda:{device}")
    raw = cuda_view(address + HEADER_SIZE, h.data_bytes, device)
    return raw.view(dtype).reshape(h.local_shape)


def cuda_view(address: int, nbytes: int, device: int) -> Any:
    """A uint8 CUDA tensor over ``nbytes`` of GPU memory at ``address`` on ``device``.
    Raises NotSupported where torch cannot make one (a build without CUDA)."""
    t = torch()
    try:
        return t.as_tensor(_CudaBytes(address, nbytes), device=f"cuda:{device}")
    except (RuntimeError, AssertionError) as exc:   # torch's errors for a CPU-only build
        raise NotSupported(f"torch cannot view GPU memory here: {exc}") from None


# -- sharding -------------------------------------------------------------------------------
def shard(tensor: Any, rank: int, count: int, split_dim: int) -> Any:
    """Slice ``rank`` of ``count`` equal slices of ``tensor`` along ``split_dim`` (a view).

    Only uniform splits are stored, as in the original; InvalidParams otherwise."""
    if not 0 <= split_dim < tensor.dim() or count <= 0 or not 0 <= rank < count:
        raise InvalidParams(f"bad shard request: rank {rank} of {count} along dim {split_dim} "
                            f"of a {tensor.dim()}-dim tensor")
    size = int(tensor.shape[split_dim])
    if size % count:
        raise InvalidParams(f"dim {split_dim} of size {size} does not split into {count} "
                            "equal shards (only uniform sharding is supported)")
    step = size // count
    return tensor.narrow(split_dim, rank * step, step)

