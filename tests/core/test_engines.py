"""Engine detection (lb.core.engines): the first adapter whose load endpoint answers in its shape."""
from __future__ import annotations

from pathlib import Path

from lb.core.engines import (AUTO, DETECT_ORDER, LOAD_ENDPOINTS, REDETECT_S, detection_due, detection_paths,
                             engine_from_answers, queue_order_due)

DATA = Path(__file__).parent.parent / "data"
VLLM_GPU = (DATA / "vllm-0.25.1-h200-metrics-idle.txt").read_bytes()
VLLM_CPU = (DATA / "vllm-0.32-cpu-metrics-busy.txt").read_bytes()
SGLANG_LOADS = (b'{"timestamp":"t","dp_rank_count":1,"loads":[{"dp_rank":0,"num_running_reqs":3,'
                b'"num_waiting_reqs":2,"num_used_tokens":100,"max_total_num_tokens":1000,"token_usage":0.1}]}')
SGLANG_GET_LOAD = b'[{"dp_rank":0,"num_reqs":5,"num_waiting_reqs":2,"num_tokens":100}]'
SGLANG_METRICS = (b'sglang:num_running_reqs{model_name="m"} 3.0\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
                  b'sglang:token_usage{model_name="m"} 0.1\n')
LLAMACPP_METRICS = (b"# HELP llamacpp:requests_processing Number of requests processing.\n"
                    b"llamacpp:requests_processing 4\nllamacpp:requests_deferred 8\n")
NOT_FOUND = None  # any answer but 200


def test_detection_reads_each_endpoint_once_sglangs_own_first():
    assert detection_paths() == ["/v1/loads", "/get_load", "/metrics"]
    assert DETECT_ORDER[0] == "sglang" and set(DETECT_ORDER) | {"openai"} == set(LOAD_ENDPOINTS)


def test_real_vllm_pages_are_vllm_and_their_load_comes_with_the_answer():
    for page, waiting in ((VLLM_GPU, 0), (VLLM_CPU, 32)):
        found = engine_from_answers({"/v1/loads": NOT_FOUND, "/get_load": NOT_FOUND, "/metrics": page})
        assert found.engine == "vllm" and found.load is not None and found.load.pending == waiting
    found = engine_from_answers({"/v1/loads": NOT_FOUND, "/get_load": NOT_FOUND, "/metrics": VLLM_GPU})
    assert found.load.kv_free_tokens == 65536 and LOAD_ENDPOINTS["vllm"][found.endpoint][0] == "/metrics"


def test_sglang_by_whichever_of_its_endpoints_answers_and_the_adapter_remembers_which():
    for bodies, path in (({"/v1/loads": SGLANG_LOADS}, "/v1/loads"), ({"/get_load": SGLANG_GET_LOAD}, "/get_load"),
                         ({"/metrics": SGLANG_METRICS}, "/metrics")):
        found = engine_from_answers({p: NOT_FOUND for p in detection_paths()} | bodies)
        assert found.engine == "sglang" and LOAD_ENDPOINTS["sglang"][found.endpoint][0] == path
        assert (found.load.pending, found.load.running) == (2, 3)


def test_a_page_with_both_families_goes_to_sglang_when_its_load_endpoint_answers():
    merged = SGLANG_METRICS + VLLM_GPU  # an exporter that merges them, or the emulator
    assert engine_from_answers({"/v1/loads": NOT_FOUND, "/get_load": SGLANG_GET_LOAD, "/metrics": merged}).engine == "sglang"


def test_llamacpp_and_servers_with_nothing_to_read():
    assert engine_from_answers({"/v1/loads": NOT_FOUND, "/get_load": NOT_FOUND, "/metrics": LLAMACPP_METRICS}).engine == "llamacpp"
    plain = engine_from_answers({p: NOT_FOUND for p in detection_paths()})
    assert plain.engine == "openai" and plain.load is None
    # 200s in no adapter's shape: an HTML page, a JSON error, another program's metrics
    odd = {"/v1/loads": b"<html>hi</html>", "/get_load": b'{"load": 3}', "/metrics": b"lb_queue_length 0\n"}
    assert engine_from_answers(odd).engine == "openai"


def test_detection_is_due_first_and_again_only_while_no_load_is_seen():
    assert detection_due(AUTO, AUTO, True, 0.0, 5.0)  # first probe
    assert not detection_due("vllm", "vllm", False, 0.0, 1e9)  # configured: never
    assert not detection_due(AUTO, "sglang", True, 0.0, 1e9)  # reading a load: no need
    assert not detection_due(AUTO, "openai", False, 100.0, 100.0 + REDETECT_S - 1)
    assert detection_due(AUTO, "openai", False, 100.0, 100.0 + REDETECT_S)
    assert detection_due(AUTO, "vllm", False, 100.0, 100.5, redetect_s=0.5)  # its metrics went away


def test_the_queue_order_is_read_once_per_engine_and_again_while_a_replica_comes_back():
    assert queue_order_due("sglang", None, detected=False, healthy=False)  # never read
    assert not queue_order_due("sglang", "sglang", detected=False, healthy=True)  # read: not every probe
    assert queue_order_due("sglang", "sglang", detected=True, healthy=True)  # its engine detected again
    assert queue_order_due("sglang", "vllm", detected=False, healthy=True)  # read for another engine
    assert queue_order_due("sglang", "sglang", detected=False, healthy=False)  # coming back: maybe restarted
