"""The whole API surface through `lb` to real emulator processes (lb.core.routes): pooling,
scoring, tokenizer, responses, audio uploads, a model's card, SGLang's native routes with and
without a model, FANOUT calls, the header allowlist both ways, and OpenAI-shaped 404/405."""
from __future__ import annotations

import hashlib
import http.client
import json
import uuid

import openai
import pytest

from bench.emulator_api import embedding
from bench.tokenizer import encode
from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb
from tests.procs import Proc, metric

pytestmark = needs_emulator


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two SGLang-faced emulators serving `m` (headers echoed), behind one lb."""
    started: list[Proc] = []
    try:
        urls = []
        for i in range(2):
            p, url = start_emulator("--echo-headers", name=f"emu{i}")
            started.append(p)
            urls.append(url)
        cfg = tmp_path_factory.mktemp("surface") / "lb.toml"
        cfg.write_text("[server]\nmax_body_bytes = 200000\n"
                       + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\nmodels = ["m"]\n' for u in urls))
        d = start_lb(config=cfg)
        started.append(d.proc)
        yield d, urls
    finally:
        for p in reversed(started):
            p.stop()


def post(d, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    return http_json("POST", d.url + path, body, headers)


def sdk(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="sk-client", max_retries=0)


# -- pooling, scoring, tokenizer ---------------------------------------------------------------
def test_openai_sdk_embeddings_through_lb(fleet):
    d, _ = fleet
    raw = sdk(d).embeddings.with_raw_response.create(model="m", input=["hello world", "good day"])
    r = raw.parse()  # the SDK asks for base64 and decodes it
    assert [e.index for e in r.data] == [0, 1] and r.model == "m"
    for e, text in zip(r.data, ["hello world", "good day"]):
        assert e.embedding == pytest.approx(embedding(encode(text)), abs=1e-6)
    assert r.usage.prompt_tokens == len(encode("hello world")) + len(encode("good day"))
    assert raw.headers["x-lb-replica"].startswith("127.0.0.1:")
    assert metric(d.url, "lb_requests_total", route="embeddings", model="m", status="200") >= 1


def test_tokenize_and_detokenize_round_trip(fleet):
    d, _ = fleet
    status, doc = post(d, "/tokenize", {"model": "m", "prompt": "Hello there, friend"})
    assert status == 200 and doc["tokens"] == encode("Hello there, friend") and doc["count"] == len(doc["tokens"])
    status, back = post(d, "/detokenize", {"model": "m", "tokens": doc["tokens"]})
    # idle replicas tie on requests in flight: lb takes the same one (by id), which knows the pieces
    assert back["_headers"]["X-LB-Replica"] == doc["_headers"]["X-LB-Replica"]
    assert status == 200 and back["prompt"] == "Hello there, friend"
    status, doc2 = post(d, "/v1/tokenize", {"model": "m", "prompt": "Hello there, friend"})
    assert status == 200 and doc2["tokens"] == doc["tokens"]
    status, err = post(d, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert metric(d.url, "lb_requests_total", route="tokenize", status="200") >= 2


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank(fleet, path):
    d, _ = fleet
    status, doc = post(d, path, {"model": "m", "query": "red apple", "documents": ["red apple", "blue sky"],
                                 "top_n": 2})
    assert status == 200 and [r["index"] for r in doc["results"]] == [0, 1]
    assert doc["results"][0]["relevance_score"] == pytest.approx(1.0)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score(fleet, path):
    d, _ = fleet
    status, doc = post(d, path, {"model": "m", "text_1": "red apple", "text_2": ["red apple", "blue sky"]})
    assert status == 200 and len(doc["data"]) == 2 and doc["data"][0]["score"] == pytest.approx(1.0)


def test_responses_plain_and_streamed(fleet):
    d, _ = fleet
    before = metric(d.url, "lb_output_tokens_total")
    r = sdk(d).responses.create(model="m", input="Say something", max_output_tokens=6)
    assert r.status == "completed" and r.output_text and r.usage.output_tokens <= 6
    assert metric(d.url, "lb_output_tokens_total") - before == r.usage.output_tokens  # its usage is read too
    events = list(sdk(d).responses.create(model="m", input="Say something", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    # a stored response lives on one replica: lb asks every one and answers the owner's
    for rid in (r.id, events[-1].response.id):
        assert sdk(d).responses.retrieve(rid).output_text
    status, doc = http_json("GET", d.url + "/v1/responses/resp_nope")
    assert status == 404 and doc["error"]["code"] == "response_not_found"
    status, doc = post(d, f"/v1/responses/{r.id}/cancel", {})
    assert status == 400 and "Cannot cancel" in doc["error"]["message"]  # the owner's error, not lb's 404


def test_model_card_by_path(fleet):
    d, _ = fleet
    status, doc = http_json("GET", d.url + "/v1/models/m")
    assert status == 200 and doc["id"] == "m" and doc["_headers"]["X-LB-Replica"]
    assert sdk(d).models.retrieve("m").id == "m"
    status, doc = http_json("GET", d.url + "/v1/models/meta-llama/none")
    assert status == 404 and doc["error"]["code"] == "model_not_found"


# -- audio uploads -----------------------------------------------------------------------------
def test_transcription_and_translation_with_the_sdk(fleet):
    d, _ = fleet
    audio = bytes(range(256)) * 300  # 76.8 kB, streamed through after the model field
    r = sdk(d).audio.transcriptions.create(model="m", file=("a.wav", audio, "audio/wav"))
    assert r.text
    raw = sdk(d).audio.translations.with_raw_response.create(model="m", file=("a.wav", audio, "audio/wav"))
    doc = json.loads(raw.text)
    assert doc["emulator"]["bytes"] == len(audio) and doc["emulator"]["sha256"] == hashlib.sha256(audio).hexdigest()


def multipart(fields: list[tuple[str, bytes, str | None]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for name, value, filename in fields:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def raw_post(d, path: str, body: bytes, ctype: str, chunked: bool = False) -> tuple[int, dict, dict]:
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    if chunked:
        c.putrequest("POST", path)
        c.putheader("Content-Type", ctype)
        c.putheader("Transfer-Encoding", "chunked")
        c.endheaders()
        for i in range(0, len(body), 7000):
            part = body[i:i + 7000]
            c.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        c.send(b"0\r\n\r\n")
    else:
        c.request("POST", path, body, {"Content-Type": ctype})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data), dict(r.getheaders())


def test_upload_with_the_file_before_the_model_and_chunked(fleet):
    d, _ = fleet
    audio = b"\x01\x02" * 20000
    body, ctype = multipart([("file", audio, "b.wav"), ("model", b"m", None), ("language", b"en", None)])
    status, doc, _ = raw_post(d, "/v1/audio/transcriptions", body, ctype)
    assert status == 200 and doc["emulator"]["bytes"] == len(audio) and doc["emulator"]["fields"] == ["language", "model"]
    status, doc, _ = raw_post(d, "/v1/audio/transcriptions", body, ctype, chunked=True)
    assert status == 200 and doc["emulator"]["sha256"] == hashlib.sha256(audio).hexdigest()
    body, ctype = multipart([("model", b"other-model", None), ("file", audio, "b.wav")])
    status, doc, _ = raw_post(d, "/v1/audio/transcriptions", body, ctype)
    assert status == 404 and doc["error"]["code"] == "model_not_found"
    big, ctype = multipart([("model", b"m", None), ("file", b"\0" * 300_000, "c.wav")])
    for chunked in (False, True):  # over [server] max_body_bytes: refused, announced or not
        status, doc, _ = raw_post(d, "/v1/audio/transcriptions", big, ctype, chunked=chunked)
        assert status == 413 and doc["error"]["code"] == "body_too_large"


def test_an_upload_is_retried_elsewhere_only_while_it_can_be_sent_again(procs, tmp_path):
    """A replica refusing with 503 after reading the upload: a small upload, held whole, is
    retried on the other replica; a large one already streamed to it cannot be, and the
    engine's refusal is passed on instead of a half-sent retry."""
    full, full_url = start_emulator("--max-queued", "0", name="full")  # refuses everything: queue full
    ok, ok_url = start_emulator(name="ok")
    procs += [full, ok]
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[routing]\npolicy = "round-robin"\n'
                   + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\nmodels = ["m"]\n' for u in (full_url, ok_url)))
    d = start_lb(config=cfg)
    procs.append(d.proc)
    small, ctype = multipart([("model", b"m", None), ("file", b"\1" * 1000, "s.wav")])
    for _ in range(4):  # round robin: the full replica comes first now and then
        status, doc, h = raw_post(d, "/v1/audio/transcriptions", small, ctype)
        assert status == 200 and h["X-LB-Replica"] == ok_url.split("//")[1], doc
    retried = metric(d.url, "lb_upstream_retries_total", reason="http_503")
    assert retried >= 1  # each time, retried on the other replica
    large, ctype = multipart([("model", b"m", None), ("file", b"\2" * 3_000_000, "l.wav")])
    refused_before = metric(d.url, "lb_upstream_errors_total", kind="http_503")
    outcomes = [raw_post(d, "/v1/audio/transcriptions", large, ctype) for _ in range(4)]
    refusals = [doc for status, doc, _ in outcomes if status == 503]
    assert refusals and all(doc["error"]["message"] == "The request queue is full." for doc in refusals)
    assert all(h["X-LB-Replica"] == ok_url.split("//")[1] for status, _, h in outcomes if status == 200)
    assert metric(d.url, "lb_upstream_errors_total", kind="http_503") - refused_before == len(refusals)
    assert metric(d.url, "lb_upstream_retries_total", reason="http_503") == retried  # no retry of a streamed upload


# -- SGLang's native routes --------------------------------------------------------------------
def test_generate_with_and_without_a_model(fleet):
    d, _ = fleet
    for body in ({"text": "Once upon", "sampling_params": {"max_new_tokens": 3}},
                 {"model": "m", "text": "Once upon", "sampling_params": {"max_new_tokens": 3}}):
        status, doc = post(d, "/generate", body)
        assert status == 200 and doc["meta_info"]["completion_tokens"] <= 3, doc
    assert metric(d.url, "lb_requests_total", route="generate", model="none", status="200") >= 1


@pytest.mark.parametrize("path", ["/get_model_info", "/get_server_info"])
def test_info_routes_fan_out(fleet, path):
    d, urls = fleet
    status, doc = http_json("GET", d.url + path)
    assert status == 200 and doc["served_model_name"] == "m"
    assert sorted(r["id"] for r in doc["lb_replicas"]) == sorted(u.split("//")[1] for u in urls)
    assert all(r["status"] == 200 for r in doc["lb_replicas"])


def test_flush_cache_reaches_every_replica(fleet):
    d, urls = fleet
    for method in ("POST", "GET"):
        status, doc = http_json(method, d.url + "/flush_cache")
        assert status == 200 and doc["flushed"] == 2 and doc["failed"] == 0, doc
    assert metric(d.url, "lb_requests_total", route="flush_cache", target="all", status="200") == 2


# -- routed, whatever the engine answers -------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/moderations", "/v1/classify", "/classify", "/pooling", "/encode"])
def test_other_model_routes_reach_a_replica(fleet, path):
    """The emulator does not implement these (SGLang/vLLM serve some, OpenAI servers the rest):
    lb routes them by model and relays the engine's own answer."""
    d, _ = fleet
    status, doc = post(d, path, {"model": "m", "input": "x", "text": "x"})
    assert status == 404 and doc["_headers"]["X-LB-Replica"].startswith("127.0.0.1:")
    assert doc["error"]["type"] == "HTTPNotFound"  # the emulator's words, not lb's


# -- errors ------------------------------------------------------------------------------------
def test_unknown_route_and_wrong_method_are_openai_errors(fleet):
    d, _ = fleet
    status, doc = http_json("POST", d.url + "/v1/nothing-here", {})
    assert status == 404 and set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == "unknown_route"
    status, doc = http_json("GET", d.url + "/v1/embeddings")
    assert status == 405 and doc["error"]["code"] == "method_not_allowed" and doc["_headers"]["Allow"] == "POST"
    status, doc = http_json("DELETE", d.url + "/flush_cache")
    assert status == 405 and doc["_headers"]["Allow"] == "GET, POST"
    status, doc = http_json("PUT", d.url + "/v1/models")
    assert status == 405 and set(doc["error"]) == {"message", "type", "param", "code"}


# -- headers -----------------------------------------------------------------------------------
SENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v",
        "OpenAI-Organization": "org-1", "OpenAI-Project": "proj-1", "X-Custom-Thing": "c",
        "X-LB-User": "alice", "Cookie": "a=b", "Authorization": "Bearer sk-client"}


def seen_upstream(doc: dict) -> dict:
    return {k.lower(): v for k, v in json.loads(doc["_headers"]["x-emulator-request-headers"]).items()}


def test_default_allowlist_both_ways(fleet):
    d, _ = fleet
    status, doc = post(d, "/v1/embeddings", {"model": "m", "input": "x"}, {**SENT, "X-Request-Id": "rid-7"})
    assert status == 200
    seen = seen_upstream(doc)
    for name in ("traceparent", "tracestate", "openai-organization", "openai-project", "authorization"):
        assert seen[name] == {k.lower(): v for k, v in SENT.items()}[name], name
    assert seen["x-request-id"] == "rid-7"
    for name in ("x-custom-thing", "x-lb-user", "cookie"):
        assert name not in seen, name
    h = doc["_headers"]
    assert h["openai-processing-ms"] == "7" and h["x-ratelimit-remaining-requests"] == "99"
    assert h["X-LB-Replica"].startswith("127.0.0.1:") and h["X-Request-Id"] == "rid-7"
    assert "Set-Cookie" not in h


def test_configured_allowlist(procs, tmp_path):
    p, url = start_emulator("--echo-headers")
    procs.append(p)
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[proxy]\nforward_headers = ["traceparent", "x-custom-*"]\n'
                   f'[identity]\napi_keys = {{"sk-client" = "alice"}}\n'
                   f'[[replicas]]\nurl = "{url}"\nengine = "vllm"\nmodels = ["m"]\n')
    d = start_lb(config=cfg)
    procs.append(d.proc)
    status, doc = post(d, "/tokenize", {"model": "m", "prompt": "x"}, SENT)
    assert status == 200
    seen = seen_upstream(doc)
    assert seen["traceparent"] == SENT["traceparent"] and seen["x-custom-thing"] == "c"
    for name in ("tracestate", "openai-organization", "x-lb-user", "authorization"):  # lb owns the key now
        assert name not in seen, name
