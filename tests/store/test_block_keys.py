"""The TP block key format shared by our vLLM store connector and the Conductor's store view."""

from mooncake_plugins.store import block_keys


def test_keys_parse_back_and_only_block_keys_parse():
    keys = block_keys.all_ranks("p/vllm/m-1/cpu-bs16", ["ab12", "cd34"], 2)
    assert keys == ["p/vllm/m-1/cpu-bs16/tp0of2/ab12", "p/vllm/m-1/cpu-bs16/tp1of2/ab12",
                    "p/vllm/m-1/cpu-bs16/tp0of2/cd34", "p/vllm/m-1/cpu-bs16/tp1of2/cd34"]
    assert [block_keys.parse(k) for k in keys[:2]] == [("p/vllm/m-1/cpu-bs16", 0, 2, "ab12"),
                                                      ("p/vllm/m-1/cpu-bs16", 1, 2, "ab12")]
    for other in ("b/tp2of2/ab12", "b/tp0of2/XYZ", "b/tp0of2/", "tp0of1/ab", "b/tp0/ab12"):
        assert block_keys.parse(other) is None, other


def test_a_block_counts_only_when_every_rank_has_it_and_only_leading_ones():
    assert block_keys.leading_blocks([1, 1, 1, 0, 1, 1], 2) == 1   # block 1 lacks rank 1
    assert block_keys.leading_blocks([1, 1, 1, 1, 1, 1], 2) == 3
    assert block_keys.leading_blocks([0, 1, 1], 1) == 0             # a hole ends the prefix
    assert block_keys.leading_blocks([], 4) == 0
