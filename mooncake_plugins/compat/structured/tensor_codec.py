"""Tensor members as bytes: the store's ``[header | data]`` tensor objects, ``torch.save``
blobs (0-d tensors, or when the object codec is unavailable) and jagged nested tensors.

The tensor object layout is :mod:`mooncake_plugins.store.tensors` (the original's): a
304-byte header whose data-byte count and shapes can be patched so that a run of rows
read from a stored tensor decodes as a tensor of its own.
"""

from __future__ import annotations

import io
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_plugins.store import tensors as tensor_layout

_DATA_BYTES_AT = 32                  # u64 in the object header
_GLOBAL_SHAPE_AT = 40                # 8 x i64
_LOCAL_SHAPE_AT = _GLOBAL_SHAPE_AT + 8 * tensor_layout.MAX_DIMS


def torch_module() -> Any:
    """torch, imported on first use."""
    return tensor_layout.torch()


def loaded_torch() -> Any:
    """torch if something already imported it, else None."""
    return sys.modules.get("torch")


def has_tensor_codec() -> bool:
    """Whether tensors can be stored as tensor objects (else ``torch.save`` is used);
    a patchable hook."""
    try:
        torch_module()
    except Exception:
        return False
    return True


def metadata_size() -> int:
    """Bytes of a tensor object's header."""
    return tensor_layout.HEADER_SIZE


def serialize(tensor: Any) -> tuple[bytes, int, int, Any]:
    """``(header, data address, data bytes, owner)`` of a CPU tensor, as the original's
    ``_serialize_tensor``; ``owner`` keeps the data alive."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    header = tensor_layout.pack_header(tensor_layout.header_of(data))
    nbytes = data.numel() * data.element_size()
    return header, (data.data_ptr() if nbytes else 0), nbytes, data


def to_bytes(tensor: Any) -> tuple[bytes, int]:
    """The tensor object of ``tensor`` and the size of its header."""
    encoded = tensor_layout.encode(tensor.detach().cpu())
    return bytes(encoded), tensor_layout.HEADER_SIZE


def from_bytes(payload: Any) -> Any:
    """The tensor in a tensor object (a fresh copy)."""
    return tensor_layout.decode(payload)


def sliced_header(header: bytes, shape: Sequence[int], data_bytes: int) -> bytes:
    """``header`` rewritten for a tensor of ``shape`` holding ``data_bytes`` bytes."""
    patched = bytearray(header)
    struct.pack_into("<Q", patched, _DATA_BYTES_AT, int(data_bytes))
    for at in (_GLOBAL_SHAPE_AT, _LOCAL_SHAPE_AT):
        struct.pack_into(f"<{len(shape)}q", patched, at, *(int(d) for d in shape))
    return bytes(patched)


def torch_save_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch_module().save(value, buffer)
    return buffer.getvalue()


def torch_load_bytes(payload: bytes) -> Any:
    return torch_module().load(io.BytesIO(payload), weights_only=True)


def tensor_field(value: Any) -> tuple[dict[str, Any], Any]:
    """Field spec and payload of a tensor member (``TensorPayload`` or nested parts)."""
    from .payloads import TensorPayload

    torch = torch_module()
    if value.is_nested:
        if value.layout != torch.jagged:
            raise ValueError("structured nested tensor fields require torch.jagged layout")
        return _nested_field(value)
    return {"encoding": "torch_tensor", "dtype": str(value.dtype), "shape": list(value.shape),
            "element_size": int(value.element_size())}, TensorPayload(value)


def _nested_field(value: Any) -> tuple[dict[str, Any], Any]:
    from .payloads import MultiBufferPayload

    spec: dict[str, Any] = {"encoding": "torch_tensor", "dtype": str(value.dtype),
                            "nested": True, "format": "torch_save"}
    parts = [value.values(), value.offsets()]
    lengths = value.lengths()
    if lengths is not None:
        parts.append(lengths)
    if has_tensor_codec() and all(p.device.type == "cpu" for p in parts):
        blobs = [to_bytes(p)[0] for p in parts]
        spec.update(format="tensor_parts", part_bytes=[len(b) for b in blobs],
                    has_lengths=lengths is not None,
                    ragged_idx=int(getattr(value, "_ragged_idx", 1)))
        return spec, MultiBufferPayload(tuple(memoryview(b) for b in blobs), tuple(blobs))
    return spec, memoryview(torch_save_bytes(value))


def nested_from_bytes(payload: bytes, spec: Mapping[str, Any]) -> Any:
    """The jagged nested tensor a nested tensor member stored."""
    fmt = spec.get("format", "torch_save")
    if fmt == "torch_save":
        return torch_load_bytes(payload)
    if fmt != "tensor_parts":
        raise ValueError(f"unsupported nested tensor payload format: {fmt}")
    sizes = spec.get("part_bytes")
    expected = 3 if spec.get("has_lengths") else 2
    if not isinstance(sizes, list) or len(sizes) != expected:
        raise ValueError("nested tensor payload has invalid part metadata")
    parts, offset = [], 0
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError("nested tensor payload has invalid part size")
        if offset + size > len(payload):
            raise ValueError("nested tensor payload is truncated")
        parts.append(from_bytes(payload[offset:offset + size]))
        offset += size
    if offset != len(payload):
        raise ValueError("nested tensor payload has trailing bytes")
    return torch_module().nested.nested_tensor_from_jagged(
        parts[0], offsets=parts[1], lengths=parts[2] if expected == 3 else None,
        jagged_dim=int(spec.get("ragged_idx", 1)))


def nested_rows(value: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of a jagged nested tensor, as a jagged nested tensor."""
    torch = torch_module()
    rows = value.unbind()
    chosen = [rows[int(i)] for i in indices]
    if chosen:
        result = torch.nested.as_nested_tensor(chosen, layout=value.layout)
    else:
        offsets = torch.zeros(1, dtype=value.offsets().dtype, device=value.offsets().device)
        result = torch.nested.nested_tensor_from_jagged(value.values()[:0], offsets=offsets)
    if hasattr(value, "_ragged_idx"):
        result._ragged_idx = value._ragged_idx
    return result


def parse_torch_dtype(name: str) -> Any:
    """``"torch.float32"`` -> ``torch.float32``."""
    torch = torch_module()
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype: {name}")
    return dtype


def numpy_dtype_of(torch_dtype_name: str) -> Any:
    """The numpy dtype matching a torch dtype name."""
    torch = torch_module()
    return torch.empty(0, dtype=parse_torch_dtype(torch_dtype_name)).numpy().dtype
