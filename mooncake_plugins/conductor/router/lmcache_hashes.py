"""LMCache's chunk hashes, computed outside LMCache from a prompt's token ids.

LMCache (0.5.x, ``ChunkedTokenDatabase``) names each full chunk of ``chunk_size`` tokens
by a chained hash: chunk ``i`` is ``hash_fn((hash of chunk i-1, tuple of its token ids,
()))``, where ``hash_fn`` is LMCache's ``pre_caching_hash_algorithm`` (``builtin``:
Python's ``hash``; ``sha256`` / ``sha256_cbor``: vLLM's functions, a digest folded to the
big-endian int of its first 8 bytes). The hash before the first chunk is 0 where LMCache
runs without vLLM (SGLang, standalone: it then has only ``builtin``); inside vLLM it is
vLLM's ``NONE_HASH`` made with the same function, from ``PYTHONHASHSEED`` where the engine
has one and ``"vllm-none-hash"`` otherwise (for ``builtin`` a string's hash is random per
process unless ``PYTHONHASHSEED`` is set, so then it must be). A remote store keys a
chunk by ``CacheEngineKey.to_string()``, ``{model}@{world size}@{worker}@{hash:x}@{dtype}``,
the hash in hex (negative for ``builtin``: ``-1f...``). Only full chunks are saved
(LMCache's default ``save_unfull_chunk: false``), so only they are hashed here.

Checked against LMCache's own ``ChunkedTokenDatabase`` in
``tests/integrations/lmcache/test_store_view.py`` and vLLM's ``init_none_hash`` in
``tests/integrations/vllm/test_vllm_hashes.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable, Sequence

from .vllm_hashes import DEFAULT_SEED, _sha256, _sha256_cbor, chained

ALGORITHMS = ("builtin", "sha256", "sha256_cbor")


def _first8(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def string_hash(text: str, seed: str) -> int:
    """Python's ``hash(text)`` in a process started with ``PYTHONHASHSEED=seed`` (this
    interpreter's version: strings hash alike from 3.11 on)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; print(hash(sys.argv[1]))", text],
                          env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True,
                          text=True, check=True, timeout=60)
    return int(proc.stdout)


class LmcacheChunkHashes:
    """Chunk hashes as LMCache computes them with ``chunk_size`` and ``algorithm`` (its
    ``pre_caching_hash_algorithm``), inside vLLM (``in_vllm``) whose engines run with
    ``PYTHONHASHSEED=seed`` (None: unset), or without vLLM.

    Raises:
        ValueError: an unknown algorithm, a chunk size < 1, or ``builtin`` inside vLLM
            without a seed (LMCache's chain then starts from a random hash per engine).
    """

    def __init__(self, chunk_size: int, algorithm: str = "builtin", seed: str | None = None,
                 in_vllm: bool = True) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"LMCache hash algorithm {algorithm!r}: one of "
                             f"{', '.join(ALGORITHMS)} is supported")
        if chunk_size < 1:
            raise ValueError(f"LMCache chunk size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        if not in_vllm:   # LMCache falls back to Python's hash, its chain starts at 0
            algorithm = "builtin"
        self._hash: Callable[[Any], int] = {
            "builtin": hash, "sha256": lambda obj: _first8(_sha256(obj)),
            "sha256_cbor": lambda obj: _first8(_sha256_cbor(obj))}[algorithm]
        if not in_vllm:
            self._root = 0
        elif algorithm != "builtin":
            self._root = self._hash(DEFAULT_SEED if seed is None else seed)
        elif seed is None or seed == "random":
            raise ValueError("LMCache's builtin hash inside vLLM starts each engine's chunk "
                             "hashes from a random value unless the engines run with "
                             "PYTHONHASHSEED set: set it there and give it here")
        elif not (seed.isdigit() and int(seed) < 1 << 32):
            raise ValueError(f"PYTHONHASHSEED {seed!r}: Python takes an integer in "
                             f"[0, 4294967295]")
        else:
            self._root = string_hash(seed, seed)

    def of(self, token_ids: Sequence[int]) -> list[str]:
        """Hex hashes (as in LMCache's keys) of the full chunks of ``token_ids``, in
        order."""
        return [f"{h:x}" for h in chained(self._hash, self._root, token_ids,
                                          self.chunk_size, len(token_ids), ())]
