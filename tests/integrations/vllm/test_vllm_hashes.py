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
