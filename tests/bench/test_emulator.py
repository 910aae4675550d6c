"""`lb-bench emulate` over real HTTP: SGLang/vLLM/OpenAI faces, KV pressure, abort, speed."""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import Proc, free_port, lb_bench, poll, scrape_metrics

MSG = [{"role": "user", "content": "Say something."}]


@contextmanager
def emulator(*args: str, name: str = "emu"):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with Proc(lb_bench("emulate", "--port", str(port), "--profile", "tiny", *args),
              ready_url=f"{url}/health", name=name):
        yield url


@pytest.fixture(scope="module")
def emu():
    with emulator("--speed", "4", "--model", "tiny-llama") as url:
        yield url


def call(method: str, url: str, body: object = None, raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            payload = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        payload, status = e.read(), e.code
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def metrics(url: str) -> dict[str, float]:
    """Sample name -> value: the emulator reports one sample per name."""
    return {s.name: s.value for samples in scrape_metrics(url).values() for s in samples}


def load(url: str) -> dict:
    return call("GET", url + "/get_load")[1][0]


def open_stream(url: str, path: str, body: dict) -> http.client.HTTPConnection:
    """Start a streaming request and leave it running; close() is a client disconnect."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    return conn


def tokens(n: int, key: int) -> list[int]:
    return [1000 * key + i for i in range(n)]


def test_pending_appears_exactly_when_kv_is_full_and_abort_frees_it():
    # tiny: 2,048 KV tokens, 16 reserved per request; slow steps keep the state still
    with emulator("--speed", "0.05") as url:
        hogs = [open_stream(url, "/v1/completions", {"prompt": tokens(440, k), "max_tokens": 60,
                                                      "ignore_eos": True}) for k in range(4)]
        poll(lambda: load(url)["num_reqs"] == 4, what="4 requests in the engine")
        first = load(url)
        assert first["num_waiting_reqs"] == 0  # 4 × 457 fit in 2,048
        m = metrics(url)
        assert m["sglang:num_queue_reqs"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert m["sglang:num_running_reqs"] == 4 and m["vllm:num_requests_running"] == 4

        late = open_stream(url, "/v1/completions", {"prompt": tokens(440, 9), "max_tokens": 60,
                                                     "ignore_eos": True})
        poll(lambda: load(url)["num_waiting_reqs"] == 1, what="the 5th request to wait")
        m = metrics(url)
        assert m["sglang:num_queue_reqs"] == 1 and m["vllm:num_requests_waiting"] == 1
        # it waits because its 440 + 16 tokens do not fit beside the others
        assert m["sglang:max_total_num_tokens"] - m["sglang:num_used_tokens"] < 457
        (loads,) = call("GET", url + "/v1/loads")[1]["loads"]
        assert loads["num_waiting_reqs"] == 1 and loads["num_running_reqs"] == 4
        assert loads["token_usage"] > 0.85

        for conn in hogs:  # the clients walk away: their KV must be freed
            conn.close()
        poll(lambda: load(url)["num_waiting_reqs"] == 0 and load(url)["num_reqs"] == 1,
             what="aborted requests to free KV for the waiting one")
        m = metrics(url)
        assert m["sglang:num_aborted_requests_total"] == 4
        assert m["sglang:num_used_tokens"] < 600
        resp = late.getresponse()
        body = resp.read().decode()
        assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in body
        late.close()


def test_abort_request_endpoint_frees_kv():
    with emulator("--speed", "0.2") as url:
        conn = open_stream(url, "/generate", {"input_ids": tokens(300, 1), "rid": "victim",
                                              "sampling_params": {"max_new_tokens": 500,
                                                                  "ignore_eos": True}})
        poll(lambda: load(url)["num_tokens"] > 300, what="the request to hold KV")
        status, _ = call("POST", url + "/flush_cache")
        assert status == 400  # refused while a request runs
        assert call("POST", url + "/abort_request", {"rid": "victim"})[0] == 200
        body = conn.getresponse().read().decode()
        assert '"type":"abort"' in body and body.endswith("data: [DONE]\n\n")
        assert load(url) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                             "num_pending_tokens": 0}
        assert call("POST", url + "/flush_cache")[0] == 200
        conns = [open_stream(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 500,
                                                           "ignore_eos": True}) for _ in range(2)]
        poll(lambda: load(url)["num_reqs"] == 2, what="two requests")
        assert call("POST", url + "/abort_request", {"abort_all": True})[0] == 200
        for c in conns:
            assert '"finish_reason":"abort"' in c.getresponse().read().decode()
        assert load(url)["num_tokens"] == 0


def test_cached_tokens_grow_on_a_repeated_prefix(emu):
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    usages, history = [], [system]
    for turn in range(3):
        history.append({"role": "user", "content": f"Question number {turn}: what next?"})
        status, doc = call("POST", emu + "/v1/chat/completions",
                           {"model": "tiny-llama", "messages": history, "max_tokens": 8})
        assert status == 200, doc
        usages.append(doc["usage"])
        history.append(doc["choices"][0]["message"])
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    # each turn's cache hit covers the whole previous turn (prompt + reply), block-aligned
    assert cached[2] >= (usages[1]["prompt_tokens"] + 8) // 16 * 16 - 16
    m = metrics(emu)
    assert m["sglang:cached_tokens_total"] >= sum(cached)
    assert m["vllm:prefix_cache_hits_total"] >= sum(cached)
    assert m["vllm:prefix_cache_queries_total"] >= sum(u["prompt_tokens"] for u in usages)


@pytest.mark.parametrize("path,raw,status,param", [
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", b'[1, 2]', 400, None),
    ("/v1/chat/completions", b'{"model": "tiny-llama"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 129}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": "2"}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": true}', 400, "n"),
    ("/v1/completions", b'{"prompt": "x", "n": -1}', 400, "n"),
    ("/generate", b'{"text": "x", "sampling_params": {"n": 0}}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ("/v1/completions", b'{"model": "tiny-llama"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "seed": "7"}', 400, "seed"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "seed": true}', 400, "seed"),
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": "hot"}}', 400, "temperature"),
    ("/generate", b'{"sampling_params": {}}', 400, "text"),
    ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
    ("/abort_request", b'{}', 400, "rid"),
    ("/v1/nothing", b'{}', 404, None),
])
def test_bad_input_gets_an_openai_error(emu, path, raw, status, param):
    got, doc = call("POST", emu + path, raw=raw)
    assert got == status, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == status


def test_queue_limit_answers_503_queue_full():
    with emulator("--speed", "0.05", "--max-queued", "1", "--max-running", "1") as url:
        conns = [open_stream(url, "/v1/completions", {"prompt": "hello", "max_tokens": 50,
                                                      "ignore_eos": True}) for _ in range(2)]
        poll(lambda: load(url)["num_waiting_reqs"] == 1, what="one running, one waiting")
        status, doc = call("POST", url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
        assert status == 503 and doc["error"]["message"] == "The request queue is full."
        for c in conns:
            c.close()


def test_speed_scales_engine_time():
    def timed(url: str) -> float:
        body = {"prompt": "time me", "max_tokens": 60, "ignore_eos": True}
        call("POST", url + "/v1/completions", body)  # warm the connection path
        t0 = time.monotonic()
        status, doc = call("POST", url + "/v1/completions", body)
        assert status == 200 and doc["usage"]["completion_tokens"] == 60
        return time.monotonic() - t0

    with emulator("--speed", "0.25", name="slow") as slow, emulator("--speed", "8", name="fast") as fast:
        # CPU load only ever adds time: the slow side's wall time is a lower bound on its engine
        # time, and the best of a few fast runs strips the scheduling delays a loaded machine adds.
        t_slow = timed(slow)
        t_fast = min(timed(fast) for _ in range(3))
    # 60 tiny steps ≈ 0.26 engine s: ≈ 1 s at 0.25×, ≈ 0.03 s at 8× (32× apart); margin for load
    assert t_slow > 3 * t_fast, (t_slow, t_fast)
    assert t_slow > 0.8  # engine time is slept, never skipped


def test_openai_sdk_streams_chat_and_completions(emu):
    client = openai.OpenAI(base_url=emu + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=MSG, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    comp = list(client.completions.create(model="tiny-llama", prompt="Once upon a time",
                                          max_tokens=5, stream=True, temperature=0,
                                          stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in comp if c.choices).strip()
    assert comp[-1].usage.completion_tokens <= 5
    # greedy decoding answers a prompt the same way each time, streamed or not
    again = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert again.choices[0].text == "".join(c.choices[0].text for c in comp if c.choices)
    # sampled decoding (the default) differently each time, unless a seed fixes the draw
    def sampled(**kw) -> str:
        return client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8,
                                         extra_body={"ignore_eos": True}, **kw).choices[0].text
    assert len({sampled() for _ in range(3)}) == 3
    assert sampled(seed=7) == sampled(seed=7) != sampled(seed=8)

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]


def test_sglang_faces(emu):
    status, info = call("GET", emu + "/server_info")
    assert status == 200 and info["model_path"] is None and info["max_total_num_tokens"] == 2048
    assert call("GET", emu + "/get_server_info")[1]["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        doc = call("GET", emu + path)[1]
        assert doc["model_path"] is None and doc["is_generation"] is True
    loads = call("GET", emu + "/v1/loads")[1]
    assert loads["dp_rank_count"] == 1 and {"num_running_reqs", "num_waiting_reqs", "token_usage",
                                              "cache_hit_rate"} <= set(loads["loads"][0])
    assert call("GET", emu + "/health_generate")[0] == 200
    assert call("GET", emu + "/ping")[0] == 200
    status, doc = call("POST", emu + "/generate", {"text": "Hello", "rid": "g1", "priority": 3,
                                                   "sampling_params": {"max_new_tokens": 4,
                                                                       "ignore_eos": True}})
    assert status == 200 and doc["meta_info"]["id"] == "g1"
    assert doc["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(doc["output_ids"]) == 4 and doc["text"]


def test_metrics_parse_with_both_engines_names(emu):
    with urllib.request.urlopen(emu + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:num_used_tokens", "sglang:max_total_num_tokens",
                 "sglang:prompt_tokens", "sglang:generation_tokens", "sglang:cached_tokens",
                 "sglang:num_requests", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:cache_config_info"):
        assert name in families, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "tiny-llama"
            if name.startswith("vllm:"):
                assert "engine" in sample.labels
    assert families["sglang:prompt_tokens"].type == "counter"
    assert families["vllm:num_requests_waiting"].type == "gauge"


def test_parallel_sampling_answers_n_choices(emu):
    client = openai.OpenAI(base_url=emu + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=6, n=3,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2]
    texts = [c.message.content for c in chat.choices]
    assert len(set(texts)) > 1  # sampled: each sample draws its own answer
    assert all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == sum(len(t.split()) for t in texts) == 18
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 18

    comp = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5, n=2,
                                     seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1] and comp.usage.completion_tokens == 10
    # sample 0 draws what a single answer draws; the others differ
    single = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5,
                                       seed=7, extra_body={"ignore_eos": True})
    assert comp.choices[0].text == single.choices[0].text != comp.choices[1].text

    status, docs = call("POST", emu + "/generate", {"text": "Hello", "rid": "par", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True, "n": 2}})
    assert status == 200 and [d["meta_info"]["id"] for d in docs] == ["par-0", "par-1"]
    assert all(len(d["output_ids"]) == 3 for d in docs)


def test_parallel_sampling_streams_every_sample(emu):
    client = openai.OpenAI(base_url=emu + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=MSG, max_tokens=8, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, finishes, roles = {}, {}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles.setdefault(choice.index, choice.delta.role)  # a sample's first chunk has the role
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and all(len(t.split()) == 8 for t in texts.values())
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and chunks[-1].choices == [] and usages[0].completion_tokens == 24


def test_parallel_samples_run_as_engine_requests_and_abort_together():
    with emulator("--speed", "0.05") as url:
        conn = open_stream(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 200,
                                                         "ignore_eos": True, "n": 4})
        poll(lambda: load(url)["num_reqs"] == 4, what="4 samples in the engine")
        m = metrics(url)
        assert m["vllm:num_requests_running"] == 4 and m["sglang:num_running_reqs"] == 4
        conn.close()  # the client walks away: every sample is aborted
        poll(lambda: load(url)["num_reqs"] == 0, what="the samples to be aborted")
        assert metrics(url)["sglang:num_aborted_requests_total"] == 4


def test_lora_adapters_are_models_with_a_parent_and_a_batch_runs_max_loras_of_them():
    with emulator("--speed", "1", "--model", "tiny-llama", "--lora-adapters", "3", "--max-loras", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        cards = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert cards == {"tiny-llama": None, "lora-0": "tiny-llama", "lora-1": "tiny-llama", "lora-2": "tiny-llama"}
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="lora-9", messages=MSG, max_tokens=2)
        # lora-0 decodes; lora-1 would be a second adapter in a batch of one: it waits
        busy = open_stream(url, "/v1/chat/completions", {"model": "lora-0", "messages": MSG, "max_tokens": 300,
                                                         "ignore_eos": True})
        try:
            busy.getresponse().readline()
            second = open_stream(url, "/v1/chat/completions", {"model": "lora-1", "messages": MSG, "max_tokens": 2})
            poll(lambda: load(url)["num_waiting_reqs"] == 1, what="lora-1's request waiting")
            # the base model takes no slot: it runs at once beside lora-0
            assert client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=2).choices
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            (info,) = families["vllm:lora_requests_info"].samples
            assert info.labels == {"max_lora": "1", "running_lora_adapters": "lora-0", "waiting_lora_adapters": "lora-1"}
            status, server = call("GET", url + "/server_info")
            assert server["enable_lora"] is True and server["max_loras_per_batch"] == 1
            # SGLang's /generate names its adapter as `lora_path`
            status, body = call("POST", url + "/generate", {"text": "hi", "lora_path": "lora-7"})
            assert status == 400 and body["error"]["param"] == "lora_path"
        finally:
            busy.close()
        second.getresponse().read()  # once lora-0's request left, lora-1's ran
