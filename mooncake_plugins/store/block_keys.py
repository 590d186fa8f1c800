"""Store keys of tensor-parallel KV blocks: ``{base}/tp{rank}of{size}/{block hash}``.

One definition of the format for the writer (our vLLM store connector, whose base names
the model and KV layout: ``integrations/mooncake_vllm/keys.py``) and the readers that
only see keys (the Conductor's store view). A block counts as stored when every rank's
key is.
"""

from __future__ import annotations

import re
from typing import Sequence

_KEY = re.compile(r"^(?P<base>.+)/tp(?P<rank>\d+)of(?P<size>\d+)/(?P<hash>[0-9a-f]+)$")


def block_key(base: str, block_hash: str, tp_rank: int, tp_size: int) -> str:
    return f"{base}/tp{tp_rank}of{tp_size}/{block_hash}"


def all_ranks(base: str, block_hashes: Sequence[str], tp_size: int) -> list[str]:
    """Every rank's key of each block, block-major: ``[b0r0, b0r1, ..., b1r0, ...]``."""
    return [block_key(base, h, r, tp_size) for h in block_hashes for r in range(tp_size)]


def leading_blocks(present: Sequence[object], tp_size: int) -> int:
    """How many leading blocks have every rank's key, given per-key presence in the
    order of :func:`all_ranks`."""
    blocks, total = 0, len(present) // tp_size
    while blocks < total and all(present[blocks * tp_size:(blocks + 1) * tp_size]):
        blocks += 1
    return blocks


def parse(key: str) -> tuple[str, int, int, str] | None:
    """``(base, rank, size, block hash)`` of a block key, or None for any other key (a
    rank outside the size included)."""
    m = _KEY.match(key)
    if m is None or int(m["rank"]) >= int(m["size"]):
        return None
    return m["base"], int(m["rank"]), int(m["size"]), m["hash"]
