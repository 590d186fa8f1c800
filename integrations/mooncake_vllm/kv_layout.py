"""Where one block's KV bytes lie in vLLM's paged KV cache tensors.

vLLM hands the worker one tensor per attention layer. The block index is one of its
dimensions (the first on the CPU backend, ``[num_blocks, kv_heads, block_size, 2*head]``;
the second on CUDA flash attention, ``[2, num_blocks, block_size, kv_heads, head]``). A
block of one layer is then one or more contiguous byte ranges at a fixed distance per
block, so a block's KV over all layers is a list of ``(address, nbytes)`` pieces: what the
store's gathered puts and scattered gets take, with no staging copy. A block's object in
the store holds its layers one after the other, each ``layer_nbytes`` long, so layer ``l``
is the object's bytes from ``l * layer_nbytes``: what a layer-wise load reads.

The tensors may live in host memory or on a CUDA device: each memory region is registered
with its location, and the engine moves CUDA memory with its own CUDA paths (cuda_ipc,
pinned staging). A KV cache on any other device is refused here, naming the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from mooncake_plugins.errors import InvalidArgument
from mooncake_plugins.transfer import cuda, memory

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _LayerPattern:
    base: int                         # address of block 0's first piece
    block_stride: int                 # bytes from one block to the next
    pieces: tuple[tuple[int, int], ...]   # (offset from the block's start, nbytes)


def _location(name: str, t: "torch.Tensor") -> str:
    """Where ``t``'s memory is, as the engine registers it: ``"*"`` for host tensors (the
    engine asks the pointer, which also finds memory CUDA manages), ``cuda:N`` for CUDA."""
    kind = t.device.type
    if kind == "cpu":
        return "*"
    if kind == "cuda":
        return f"cuda:{t.device.index if t.device.index is not None else 0}"
    raise ValueError(f"layer {name}: KV cache on {t.device}; the transfer engine moves host "
                     "(cpu) and CUDA memory only")


def _resolve(address: int, nbytes: int, location: str) -> str:
    """``"cpu"`` or ``"cuda:N"``, as the engine will register the region; a CUDA KV cache
    where our CUDA driver binding cannot work is refused now, with the reason."""
    try:
        if location.startswith("cuda") and not cuda.available():
            raise InvalidArgument(f"moving it needs CUDA, and {cuda.why_unavailable()}")
        return memory.registration_location(address, nbytes, location)
    except InvalidArgument as exc:
        raise ValueError(f"KV cache memory 0x{address:x}+{nbytes} ({location}): {exc}") from None


def _contiguous_pieces(t: "torch.Tensor") -> list[tuple[int, int]]:
    """``t`` as ``(byte offset from t's first element, nbytes)`` runs, in index order."""
    size = t.element_size()
    shape, strides = list(t.shape), list(t.stride())
    # the longest suffix of dims that is dense row-major
    run, expect, k = 1, 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expect):
        run *= shape[k - 1]
        expect *= shape[k - 1]
        k -= 1
    offsets = [0]
    for dim in range(k):
        offsets = [o + i * strides[dim] for o in offsets for i in range(shape[dim])]
    return [(o * size, run * size) for o in offsets]


class KVLayout:
    """Per-block ``(address, nbytes)`` pieces over all layers' KV tensors.

    Args:
        kv_caches: layer name -> KV tensor, as vLLM's ``register_kv_caches`` gives them.
        num_blocks: the number of blocks (``kv_cache_config.num_blocks``): the size of
            the block dimension, which locates it.

    Raises:
        ValueError: a tensor without a dimension of ``num_blocks``, or layers that
            disagree on the bytes of one block.
    """

    def __init__(self, kv_caches: Mapping[str, "torch.Tensor"], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        self.layer_names = list(kv_caches)
        self.num_blocks = num_blocks
        self._patterns: list[_LayerPattern] = []
        spans: dict[int, tuple[int, str]] = {}
        for name, t in kv_caches.items():
            location = _location(name, t)
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"layer {name}: shape {tuple(t.shape)} has no block "
                                 f"dimension of {num_blocks}")
            d = dims[0]
            block0 = t.select(d, 0)
            pieces = tuple(_contiguous_pieces(block0))
            self._patterns.append(_LayerPattern(block0.data_ptr(), t.stride(d) * t.element_size(),
                                                pieces))
            storage = t.untyped_storage()
            start = storage.data_ptr()
            spans[start] = (max(spans.get(start, (0, ""))[0], storage.nbytes()), location)
        sizes = {sum(n for _, n in p.pieces) for p in self._patterns}
        if len(sizes) != 1:
            raise ValueError(f"layers disagree on the bytes of one block: {sorted(sizes)}")
        self.layer_nbytes = sizes.pop()
        self.block_nbytes = self.layer_nbytes * len(self._patterns)
        self.regions = sorted((a, n, _resolve(a, n, loc)) for a, (n, loc) in spans.items())
        """Distinct ``(address, nbytes, location)`` memory behind the tensors, for
        registration (location ``"cpu"`` or ``"cuda:N"``)."""
        self.cuda_devices = sorted({int(loc[5:]) for _, _, loc in self.regions
                                    if loc.startswith("cuda:")})
        """CUDA devices the KV cache lives on (empty: host memory)."""
        self.pieces_per_block = sum(len(p.pieces) for p in self._patterns)

    def block_pieces(self, block_id: int) -> list[tuple[int, int]]:
        """The block's bytes over all layers, in layer order."""
        return [piece for layer in range(len(self._patterns))
                for piece in self.layer_pieces(block_id, layer)]

    def layer_pieces(self, block_id: int, layer: int) -> list[tuple[int, int]]:
        """The block's bytes of one layer (its index in ``layer_names``)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside 0..{self.num_blocks - 1}")
        p = self._patterns[layer]
        start = p.base + block_id * p.block_stride
        return [(start + off, n) for off, n in p.pieces]

    def describe(self) -> str:
        """A short text of the layout, for logs."""
        where = ", ".join(f"cuda:{d}" for d in self.cuda_devices) or "host memory"
        return (f"{len(self._patterns)} layers, {self.block_nbytes} bytes per block in "
                f"{self.pieces_per_block} pieces, {len(self.regions)} memory regions in {where}")
