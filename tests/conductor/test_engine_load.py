"""Reading an engine's own load from a vLLM /metrics page."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_plugins.conductor.router.engine_load import EngineLoad, parse_engine_load

REAL_PAGE = Path(__file__).parent / "data" / "vllm_0.32_metrics.txt"

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 4.0
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 1000.0
vllm:request_prompt_tokens_count{engine="1",model_name="m"} 1.0
vllm:request_prompt_tokens_sum{engine="1",model_name="m"} 500.0
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_count{engine="0",model_name="m"} 5.0
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 80.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1500.0
"""


def test_counts_are_summed_over_engines_and_means_taken_from_the_histograms():
    assert parse_engine_load(PAGE) == EngineLoad(running=4, waiting=2,
                                                 mean_prompt_tokens=300.0,
                                                 mean_output_tokens=16.0,
                                                 block_size=128)


def test_a_real_vllm_page_reads_as_parsed_whole():
    """Only the lines read are parsed (a vLLM page is mostly histogram buckets): a real
    page gives what the whole page parsed holds."""
    page = REAL_PAGE.read_text()
    whole = {sample.name: sample for family in text_string_to_metric_families(page)
             for sample in family.samples}
    prompts = whole["vllm:request_prompt_tokens_sum"].value / \
        whole["vllm:request_prompt_tokens_count"].value
    outputs = whole["vllm:request_generation_tokens_sum"].value / \
        whole["vllm:request_generation_tokens_count"].value
    assert (prompts, outputs) == (1801 / 3, 4.0)
    assert parse_engine_load(page) == EngineLoad(
        round(whole["vllm:num_requests_running"].value),
        round(whole["vllm:num_requests_waiting"].value), prompts, outputs,
        int(whole["vllm:cache_config_info"].labels["block_size"]))


def test_a_malformed_line_of_a_metric_not_read_is_not_looked_at():
    page = 'vllm:num_requests_running 2.0\nvllm:time_to_first_token_seconds_bucket{le="1" 3\n'
    assert parse_engine_load(page) == EngineLoad(2, 0)


@pytest.mark.parametrize("label", ['block_size="none"', 'block_size="0"', 'block_size="-16"',
                                   'cache_dtype="auto"'])
def test_a_block_size_the_page_does_not_give_as_a_positive_number_is_unknown(label):
    page = f'vllm:num_requests_running 1.0\nvllm:cache_config_info{{{label}}} 1.0\n'
    assert parse_engine_load(page) == EngineLoad(1, 0)


def test_an_engine_that_finished_nothing_has_no_means_and_a_non_vllm_page_no_load():
    page = 'vllm:num_requests_running{engine="0"} 1.0\n'
    assert parse_engine_load(page) == EngineLoad(1, 0, None, None)
    assert parse_engine_load("process_cpu_seconds_total 3.0\n") is None
    assert parse_engine_load("") is None


@pytest.mark.parametrize("page", [
    'vllm:num_requests_running{engine="0"} many\n',
    'vllm:num_requests_running{engine="0"} -1.0\n',
    'vllm:num_requests_waiting{engine="0"} NaN\n',
    'vllm:num_requests_running{engine="0"} +Inf\n',
    'vllm:num_requests_running{engine="0" 1.0\n',
])
def test_a_malformed_page_or_count_is_refused(page):
    with pytest.raises(ValueError):
        parse_engine_load(page)
