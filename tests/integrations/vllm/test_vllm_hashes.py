"""The router's vLLM block hashes (``conductor/router/vllm_hashes.py``) equal vLLM's own:
the chain ``hash_block_tokens`` builds from ``NONE_HASH``, for each supported algorithm,
with and without ``PYTHONHASHSEED``."""

from __future__ import annotations

import random

import pytest

from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "1234"])
def test_block_hashes_match_vllms(algorithm, seed, monkeypatch):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    saved = getattr(kcu, "NONE_HASH", None)   # set by an engine's init_none_hash
    fn = get_hash_fn_by_name(algorithm)
    try:
        kcu.init_none_hash(fn)
        tokens = [random.Random(7).randrange(1000) for _ in range(5 * 16 + 3)]
        theirs, parent = [], None
        for i in range(5):
            parent = kcu.hash_block_tokens(fn, parent, tokens[i * 16:(i + 1) * 16])
            theirs.append(bytes(parent))
    finally:
        if saved is None:
            del kcu.NONE_HASH
        else:
            kcu.NONE_HASH = saved
    ours = VllmBlockHashes(16, algorithm, seed)
    assert ours.of(tokens) == theirs
    assert ours.of(tokens, limit=2) == theirs[:2]
    assert VllmBlockHashes(16, algorithm, "other").of(tokens)[0] != theirs[0]


def test_unsupported_algorithms_are_refused():
    with pytest.raises(ValueError, match="xxhash"):
        VllmBlockHashes(16, "xxhash")


@pytest.mark.parametrize("cache_prefix", ["", "deployment-a"])
def test_the_in_tree_store_connectors_keys_are_read_as_vllm_builds_them(cache_prefix):
    """The store view parses the keys vLLM's MooncakeStoreConnector writes (built here by
    its own PoolKey) and builds the same keys for every rank."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata, PoolKey)

    from mooncake_plugins.conductor.router.store_view import Layout

    block = "ab" * 32
    keys = [PoolKey(KeyMetadata("/models/tiny", rank, 0, 0, 0, cache_prefix=cache_prefix),
                    block).to_string() for rank in range(2)]
    layout, rank = Layout.of(keys[1])
    assert (layout.kind, layout.size, rank) == ("vllm", 2, 1)
    assert layout.keys([block]) == keys


# LMCache 0.5.6 inside vLLM (TokenDatabase.__init__, _hash_tokens), run in an engine-like
# process whose PYTHONHASHSEED seeds Python's string hash: the hash function is vLLM's by
# name, Python's hash where vLLM has none of that name (builtin); the chain starts from
# vLLM's NONE_HASH made with it; digests are folded to the int of their first 8 bytes.
LMCACHE_IN_VLLM = """
import json, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
algorithm, chunk, tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
try:
    fn = get_hash_fn_by_name(algorithm)
except ValueError:
    fn = hash
def to_int(h):
    return int.from_bytes(h[:8], "big") if isinstance(h, bytes) else h
kcu.init_none_hash(fn)
parent, out = to_int(kcu.NONE_HASH), []
for i in range(len(tokens) // chunk):
    parent = to_int(fn((parent, tuple(tokens[i * chunk:(i + 1) * chunk]), ())))
    out.append(f"{parent:x}")
print(json.dumps(out))
"""


@pytest.mark.parametrize("algorithm,seed", [("builtin", "0"), ("builtin", "77"),
                                            ("sha256", None), ("sha256_cbor", "5")])
def test_lmcache_chunk_hashes_match_lmcache_inside_vllm(algorithm, seed):
    import json
    import os
    import subprocess
    import sys

    from mooncake_plugins.conductor.router.lmcache_hashes import LmcacheChunkHashes

    tokens = [random.Random(3).randrange(32000) for _ in range(3 * 32 + 5)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    theirs = json.loads(subprocess.run(
        [sys.executable, "-c", LMCACHE_IN_VLLM, algorithm, "32", json.dumps(tokens)],
        env=env, capture_output=True, text=True, check=True, timeout=300).stdout)
    assert len(theirs) == 3
    assert LmcacheChunkHashes(32, algorithm, seed).of(tokens) == theirs
    assert LmcacheChunkHashes(32, algorithm, "78").of(tokens)[0] != theirs[0]
