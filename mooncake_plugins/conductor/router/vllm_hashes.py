"""vLLM's prefix-cache block hashes, computed outside vLLM from a prompt's token ids.

vLLM (v1) names each full block of a prompt by a chained hash: block ``i`` is
``hash_fn((hash of block i-1, tuple of block i's token ids, extra keys))`` and the block
before the first is ``hash_fn(seed)``, where the seed is ``PYTHONHASHSEED`` when the
engine has one and ``"vllm-none-hash"`` otherwise (for the default ``sha256``;
``--prefix-caching-hash-algo``). ``sha256`` hashes the pickled tuple, ``sha256_cbor`` its
canonical CBOR. Extra keys (LoRA, multimodal inputs, cache salt) are None for a plain
text or token prompt, the only kind this module hashes.

Our vLLM store connector keys a block by this hash (``integrations/mooncake_vllm/keys.py``),
so a router that computes it can ask the store which of a prompt's blocks it holds.
Checked against vLLM's own function in ``tests/integrations/vllm/test_vllm_hashes.py``.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, Sequence

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor")


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2   # vLLM's own dependency; only this algorithm needs it
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def chained(hash_fn: Callable[[Any], Any], root: Any, token_ids: Sequence[int], size: int,
            count: int, extra: Any) -> list[Any]:
    """The first ``count`` full ``size``-token pieces of ``token_ids`` hashed in a chain
    from ``root``: each ``hash_fn((previous hash, tuple of its token ids, extra))`` (vLLM's
    blocks with ``extra`` None, LMCache's chunks with ``()``)."""
    out, parent = [], root
    for i in range(min(count, len(token_ids) // size)):
        parent = hash_fn((parent, tuple(token_ids[i * size:(i + 1) * size]), extra))
        out.append(parent)
    return out


class VllmBlockHashes:
    """Block hashes as a vLLM engine started with ``--prefix-caching-hash-algo algorithm``
    and ``PYTHONHASHSEED=seed`` (None: unset) computes them.

    Raises:
        ValueError: an algorithm other than sha256 or sha256_cbor (the xxhash ones are
            seeded at random per process unless PYTHONHASHSEED is set, and not supported).
    """

    def __init__(self, block_size: int, algorithm: str = "sha256",
                 seed: str | None = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"prefix-caching hash algorithm {algorithm!r}: one of "
                             f"{', '.join(ALGORITHMS)} is supported")
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._hash: Callable[[Any], bytes] = _sha256 if algorithm == "sha256" else _sha256_cbor
        self._root = self._hash(DEFAULT_SEED if seed is None else seed)

    def of(self, token_ids: Sequence[int], limit: int | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` (at most ``limit``), in order."""
        return chained(self._hash, self._root, token_ids, self.block_size,
                       len(token_ids) if limit is None else limit, None)
