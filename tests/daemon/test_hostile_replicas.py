"""Hostile replicas against a real `lb` on loopback (issue 13): `bench/faulty_replica.py`
sends each broken shape (bad chunk size, CR in a header, status 999, a never-ending SSE line,
huge bodies and error bodies, gzip nobody asked for, a hang its probes hide) and every one
is answered: retried elsewhere, or an OpenAI-shaped error with its real status in the access
log and `lb_requests_total`, or (after the first byte) an SSE error event and `[DONE]`.
Memory stays bounded while each bound is pushed (VmHWM, the peak RSS, from /proc).

`alone`: an `lb` whose only replica is the hostile one (so the shape reaches the client);
`paired`: the hostile replica next to a well-behaved one, round-robin (so it can be retried).
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import uuid
from pathlib import Path

import pytest

from tests.daemon.conftest import http_json, start_lb
from tests.daemon.test_hostile import access_line
from tests.procs import PYTHON, Proc, free_port, metric, poll

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MIB = 1 << 20
BOUNDS = ("[upstream]\nretries = 1\nmax_response_bytes = 1048576\nmax_error_body_bytes = 4096\n"
          "max_sse_line_bytes = 65536\nhung_after_s = 1.0\n[breaker]\nfailures = 0\n")


def faulty(name: str) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return Proc([PYTHON, "-m", "bench.faulty_replica", "--port", str(port), "--token-delay-s", "0"],
                ready_url=url + "/fault", name=name), url


@pytest.fixture(scope="module")
def replicas():
    (hp, hostile), (gp, good) = faulty("hostile"), faulty("good")
    yield hostile, good
    hp.stop()
    gp.stop()


def lb_over(tmp: Path, urls: list[str], extra: str = "") -> "object":
    cfg = tmp / "lb.toml"
    cfg.write_text(BOUNDS + extra + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\nmodels = ["m"]\n'
                                            for u in urls))
    return start_lb(config=cfg)


@pytest.fixture(scope="module")
def alone(replicas, tmp_path_factory):
    d = lb_over(tmp_path_factory.mktemp("alone"), [replicas[0]])
    yield d
    d.proc.stop()


@pytest.fixture(scope="module")
def paired(replicas, tmp_path_factory):
    d = lb_over(tmp_path_factory.mktemp("paired"), list(replicas), '[routing]\npolicy = "round-robin"\n')
    yield d
    d.proc.stop()


@pytest.fixture
def hostile(replicas):
    """Set the hostile replica's behaviour; back to well-behaved after the test."""
    url = replicas[0]

    def set_(**behaviour):
        status, doc = http_json("POST", url + "/fault", behaviour)
        assert status == 200, doc
        return doc

    yield set_
    set_(mode="ok", probe="honest", tokens=8, token_delay_s=0.0)


def call(d, stream: bool = False, body: dict = CHAT) -> tuple[int, dict, bytes, str]:
    """One chat request: (status, headers, raw body, request id)."""
    rid = "t-" + uuid.uuid4().hex[:12]
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": stream}),
                     {"Content-Type": "application/json", "X-Request-Id": rid})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), rid
    finally:
        conn.close()


def openai_error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def peak_rss_mb(pid: int) -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


SHAPES = ("bad_chunk", "cr_header", "bad_status", "endless_line")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_broken_http_alone_is_an_openai_502_with_its_real_status(alone, hostile, shape, stream):
    hostile(mode=shape, size_bytes=4 * MIB)
    requests_502 = metric(alone.url, "lb_requests_total", status="502")
    status, headers, raw, rid = call(alone, stream)
    assert status == 502, (status, raw[:300])
    assert headers["content-type"].startswith("application/json")
    assert "aiohttp" not in headers.get("server", "")
    assert openai_error(raw)["type"] == "server_error"
    line = access_line(alone, rid)
    assert line["status"] == 502 and line["attempts"] == 2, line
    assert metric(alone.url, "lb_requests_total", status="502") == requests_502 + 1
    assert metric(alone.url, "lb_upstream_errors_total") > 0


def test_broken_http_is_retried_on_the_other_replica(paired, hostile, replicas):
    for shape in SHAPES:
        hostile(mode=shape, size_bytes=4 * MIB)
        for stream in (False, True):
            for _ in range(2):  # round-robin: one of two starts on the hostile replica
                status, _, raw, rid = call(paired, stream)
                assert status == 200, (shape, stream, raw[:300])
                if stream:
                    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    assert http_json("GET", replicas[0] + "/fault")[1]["received"] >= 8
    assert metric(paired.url, "lb_upstream_retries_total") >= 8


def test_each_bound_answers_a_clear_error_and_memory_stays_flat(alone, hostile):
    pid = alone.proc.popen.pid
    call(alone)  # warm
    peak0 = peak_rss_mb(pid)
    hostile(mode="huge_body", size_bytes=128 * MIB)
    status, _, raw, _ = call(alone)
    assert status == 502 and openai_error(raw)["code"] == "upstream_too_large", raw[:300]
    hostile(mode="huge_error", size_bytes=128 * MIB)
    status, _, raw, rid = call(alone)
    assert status == 500 and "huge failure" in openai_error(raw)["message"], raw[:300]
    assert access_line(alone, rid)["status"] == 500
    hostile(mode="endless_line", size_bytes=128 * MIB)
    for stream in (False, True):
        status, _, raw, _ = call(alone, stream)
        assert status == 502, raw[:300]
    growth = peak_rss_mb(pid) - peak0
    print(f"\npeak RSS growth over 4 x 128 MiB hostile answers: {growth:.1f} MB")
    assert growth < 40, growth
    hostile(mode="ok")
    assert call(alone)[0] == 200


def test_gzip_from_a_replica_is_decoded_for_the_client(alone, hostile):
    hostile(mode="gzip")
    status, headers, raw, _ = call(alone)
    assert status == 200 and "content-encoding" not in headers
    assert json.loads(raw)["choices"][0]["message"]["content"] == "zipped"


def test_a_cookie_a_replica_sets_never_reaches_a_client_or_a_later_request(hostile, replicas, tmp_path):
    # by host name: an HTTP client's cookie jar keeps no cookies from a bare IP address
    d = lb_over(tmp_path, [replicas[0].replace("127.0.0.1", "localhost")])
    try:
        hostile(mode="cookie")
        for _ in range(3):  # one keep-alive upstream connection and client session serve them all
            status, headers, raw, _ = call(d)
            assert status == 200 and "set-cookie" not in headers, headers
        _, seen = http_json("GET", replicas[0] + "/fault")
        assert "cookie" not in {k.lower() for k in seen["last_headers"]}, seen["last_headers"]
    finally:
        d.proc.stop()


def assert_stream_ended_with_error(d, code: str, reason: str) -> None:
    """A stream that began (a first event) and ended with an error event `code`, then [DONE]."""
    status, _, raw, rid = call(d, stream=True)
    assert status == 200
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert b'"choices"' in events[0]
    assert json.loads(events[-2][len(b"data: "):])["error"]["code"] == code
    assert events[-1] == b"data: [DONE]"
    assert access_line(d, rid)["reason"] == reason


def test_a_stream_broken_after_its_first_byte_ends_with_an_error_event(alone, hostile):
    hostile(mode="mid_break", tokens=6, die_after=2, token_delay_s=0.05)
    assert_stream_ended_with_error(alone, "upstream_error", "upstream_broken_stream")


def test_a_hung_request_is_retried_elsewhere_and_the_replica_marked_suspect(paired, hostile, replicas):
    """The replica accepts and never answers while its probes say it is idle: after
    upstream.hung_after_s (1 s here) the request goes to the other replica (not 600 s)."""
    hostile(mode="hang", probe="lie")
    received = http_json("GET", replicas[0] + "/fault")[1]["received"]
    for _ in range(2):
        status, _, raw, rid = call(paired)
        assert status == 200, raw[:300]
    assert http_json("GET", replicas[0] + "/fault")[1]["received"] >= received + 1
    assert metric(paired.url, "lb_upstream_errors_total", kind="hung") >= 1
    _, doc = http_json("GET", paired.url + "/admin/replicas", headers={"Authorization": "Bearer admin-secret"})
    assert [r["suspect"] for r in doc["replicas"] if r["url"] == replicas[0]] == [True]


def test_a_body_that_never_comes_is_retried_elsewhere_once_the_probes_show_it_hung(paired, hostile, replicas):
    hostile(mode="hang_body", probe="lie")
    hung = metric(paired.url, "lb_upstream_errors_total", kind="hung")
    for _ in range(2):  # round-robin: one of two starts on the hostile replica
        status, _, raw, _ = call(paired)
        assert status == 200 and json.loads(raw)["choices"], raw[:300]
    assert metric(paired.url, "lb_upstream_errors_total", kind="hung") > hung


def test_a_stream_hung_after_its_first_byte_ends_with_an_error_event(alone, hostile):
    hostile(mode="ok", probe="lie", tokens=3, token_delay_s=1000.0)
    assert_stream_ended_with_error(alone, "upstream_hung", "upstream_hung")


def test_a_client_leaving_after_the_first_byte_is_logged_499_client_disconnected(alone, hostile):
    hostile(mode="ok", tokens=200, token_delay_s=0.05)
    rid = "leave-" + uuid.uuid4().hex[:8]
    body = json.dumps({**CHAT, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", alone.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
        seen = b""
        while b"data:" not in seen:  # headers, then the first event
            chunk = s.recv(65536)
            assert chunk, seen
            seen += chunk
    line = access_line(alone, rid)
    assert (line["status"], line["reason"]) == (499, "client_disconnected"), line


def test_job_bounds_answer_429_and_memory_and_journal_stay_bounded(replicas, hostile, tmp_path):
    """Issue 13 case 4: 1 MiB jobs from one tenant, then from many, while the replica holds
    every request (so none finishes): per-tenant and total bounds answer 429, a body over a
    tenant's budget 413; RSS and the journal stay bounded (before: 150 jobs took lb from 45 to
    235 MB and wrote a 151 MB journal)."""
    hostile(mode="hang")
    persist = tmp_path / "jobs"
    d = lb_over(tmp_path, [replicas[0]], f'[deferred]\npersist_dir = "{persist}"\nmax_jobs_per_tenant = 3\n'
                f'max_job_bytes_per_tenant = 4194304\nmax_job_bytes = 8388608\nmax_journal_bytes = 12582912\n')
    pid = d.proc.popen.pid

    def job(user: str, size: int = MIB) -> tuple[int, dict]:
        line = {"url": "/v1/chat/completions",
                "body": {**CHAT, "messages": [{"role": "user", "content": "x" * size}]}}
        return http_json("POST", d.url + "/v1/lb/jobs", line, {"x-lb-user": user})

    try:
        assert job("warm", 10)[0] == 202
        peak0 = peak_rss_mb(pid)
        answers = [job("alice") for _ in range(6)]
        codes = [a[0] for a in answers]
        assert codes == [202] * 3 + [429] * 3, (codes, [http_json("GET", d.url + "/v1/lb/jobs/" + a[1]["id"])[1]
                                                        for a in answers if a[0] == 202])
        status, doc = job("alice")
        assert status == 429 and doc["error"]["code"] == "too_many_jobs" and doc["error"]["type"] == "rate_limit_error"
        status, doc = job("bob", 5 * MIB)
        assert status == 413 and doc["error"]["code"] == "job_too_large", doc
        codes = [job(f"user-{i}")[0] for i in range(30)]
        assert codes.count(202) == 4 and set(codes) == {202, 429}, codes  # 8 MiB in all, 3 + 1 taken
        growth = peak_rss_mb(pid) - peak0
        journal = (persist / "jobs.jsonl").stat().st_size
        print(f"\n38 x 1 MiB jobs posted: peak RSS +{growth:.1f} MB, journal {journal / MIB:.1f} MiB")
        assert growth < 60, growth
        assert journal <= 12 * MIB + MIB
    finally:
        d.proc.stop()


def test_finished_jobs_make_room_and_the_journal_is_compacted_at_its_bound(replicas, hostile, tmp_path):
    """Jobs that finish keep their results until the totals need room (oldest go first), and
    the journal is compacted when it outgrows deferred.max_journal_bytes."""
    persist = tmp_path / "jobs"
    d = lb_over(tmp_path, [replicas[0]], f'[deferred]\npersist_dir = "{persist}"\n'
                f'max_job_bytes = 4194304\nmax_journal_bytes = 6291456\n')
    line = {"url": "/v1/chat/completions", "body": {**CHAT, "messages": [{"role": "user", "content": "x" * MIB}]}}
    try:
        ids, sizes = [], []
        for _ in range(12):
            status, doc = http_json("POST", d.url + "/v1/lb/jobs", line)
            assert status == 202, doc
            ids.append(doc["id"])
            poll(lambda: http_json("GET", f"{d.url}/v1/lb/jobs/{ids[-1]}")[1].get("status") == "completed",
                 what="the job to complete")
            sizes.append((persist / "jobs.jsonl").stat().st_size)
        assert max(sizes) <= 6 * MIB + 2 * MIB, sizes
        kept = [http_json("GET", f"{d.url}/v1/lb/jobs/{j}")[0] for j in ids]
        assert kept[-1] == 200 and kept[0] == 404 and kept.count(200) <= 4, kept  # the oldest results went first
    finally:
        d.proc.stop()


def test_a_gzipped_stream_is_decoded_for_the_client(alone, hostile):
    hostile(mode="gzip")
    status, headers, raw, _ = call(alone, stream=True)
    assert status == 200 and "content-encoding" not in headers
    assert b'"zipped"' in raw and raw.endswith(b"data: [DONE]\n\n")
