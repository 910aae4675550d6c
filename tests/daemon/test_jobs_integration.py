"""Durable batch jobs over loopback: a real `lb` (restarted on the same persist dir) in front
of a real emulator that is busy with other work."""
from __future__ import annotations

import json
import signal

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.daemon.test_admission_integration import body, chat, lower, saturate
from tests.procs import metric, poll

pytestmark = needs_emulator


def submit(lb, line: dict | bytes, headers: dict | None = None):
    return http_json("POST", lb.url + "/v1/lb/jobs", line, headers=headers)


def line(i: int, max_tokens: int = 5) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(max_tokens)}


def test_durable_jobs_survive_a_restart_and_complete(procs, tmp_path, pool):
    persist = tmp_path / "jobs"
    toml = f'[deferred]\npersist_dir = "{persist}"\n[server]\nshutdown_grace_s = 0.5\n'
    lb, urls = start_lb_with_emulator(procs, tmp_path, toml, "--max-running", "1")
    blockers = saturate(pool, lb, 3)  # the region is busy: batch work must wait
    ids, custom = [], {}
    for i in range(2):
        status, doc = submit(lb, line(i), {"x-lb-user": "batch"})
        assert status == 202 and doc["status"] == "queued" and doc["custom_id"] == f"req-{i}"
        assert lower(doc["_headers"])["location"] == f"/v1/lb/jobs/{doc['id']}"
        ids.append(doc["id"])
        custom[doc["id"]] = f"req-{i}"
    status, doc = chat(lb, body(max_tokens=5), {"x-lb-durable": "1", "x-lb-user": "batch"})  # same, inline
    assert status == 202 and doc["url"] == "/v1/chat/completions"
    ids.append(doc["id"])
    custom[doc["id"]] = None
    poll(lambda: metric(lb.url, "lb_deferred_waiting") == 3, what="the jobs to wait in the deferred queue")
    assert all(http_json("GET", f"{lb.url}/v1/lb/jobs/{j}")[1]["status"] == "queued" for j in ids)

    lb.proc.signal(signal.SIGTERM)  # the jobs are only in the journal now
    assert lb.proc.popen.wait(timeout=20) == 0
    for f in blockers:
        f.result(timeout=20)  # each ended (served or cut with a clear error)
    journal = [json.loads(x) for x in (persist / "jobs.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in journal if r["op"] == "submit") == sorted(ids)
    assert not any(r["op"] == "finish" for r in journal)  # none ran before the restart

    lb2, _ = start_lb_with_emulator(procs, tmp_path, toml, name="lb2", urls=urls)

    def finished() -> bool:
        return all(http_json("GET", f"{lb2.url}/v1/lb/jobs/{j}")[1]["status"] == "completed" for j in ids)

    poll(finished, timeout=30, what="the jobs to complete after the restart")
    for j in ids:
        status, doc = http_json("GET", f"{lb2.url}/v1/lb/jobs/{j}")
        assert status == 200 and doc["custom_id"] == custom[j]
        resp = doc["response"]
        assert resp["status_code"] == 200 and resp["body"]["usage"]["completion_tokens"] == 5
        assert resp["body"]["choices"][0]["message"]["content"]
    assert metric(lb2.url, "lb_jobs_finished_total", status="completed") == 3
    assert metric(lb2.url, "lb_jobs_unfinished") == 0


def test_bad_job_ids_and_bodies_get_openai_errors(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, f'[deferred]\npersist_dir = "{tmp_path / "jobs"}"\n',
                                   "--speed", "50")
    status, doc = http_json("GET", lb.url + "/v1/lb/jobs/job_nope")
    assert status == 404 and doc["error"]["code"] == "job_not_found" and doc["error"]["type"] == "not_found_error"
    assert submit(lb, b"{not json")[0] == 400
    for bad, param in (({**line(0), "url": "/v1/embeddings"}, "url"), ({"url": "/v1/chat/completions"}, "body"),
                       ({**line(0), "body": {"model": "m"}}, "messages"),
                       ({**line(0), "body": {**body(), "stream": True}}, "stream")):
        status, doc = submit(lb, bad)
        assert status == 400 and doc["error"]["param"] == param, (bad, doc)
    status, doc = submit(lb, {**line(0), "body": {**body(), "model": "nope"}})
    assert status == 404 and doc["error"]["code"] == "model_not_found"
    status, doc = chat(lb, body(), {"x-lb-durable": "perhaps"})
    assert status == 400 and doc["error"]["param"] == "x-lb-durable"
    status, doc = chat(lb, body(), {"x-lb-durable": "1", "x-lb-tier": "iw-f"})
    assert status == 400 and doc["error"]["param"] == "x-lb-tier"
    assert chat(lb, body(), {"x-lb-durable": "0"})[0] == 200  # not durable: served inline
    status, doc = submit(lb, line(1))  # an idle region runs it soon
    poll(lambda: http_json("GET", f"{lb.url}/v1/lb/jobs/{doc['id']}")[1]["status"] == "completed",
         what="the job to complete")


def test_jobs_are_off_without_a_persist_dir(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, "", "--speed", "50")
    status, doc = submit(lb, line(0))
    assert status == 400 and doc["error"]["code"] == "jobs_disabled" and "persist_dir" in doc["error"]["message"]


def test_a_full_deferred_queue_makes_jobs_wait_never_fail(procs, tmp_path):
    """Issue 13 case 1: 30 jobs acknowledged with room for 2 in the deferred queue all run
    (before: half failed with 500 "lb: AssertionError" and 0 attempts)."""
    toml = f'[deferred]\npersist_dir = "{tmp_path / "jobs"}"\nmax_entries = 2\n'
    lb, _ = start_lb_with_emulator(procs, tmp_path, toml, "--speed", "50")
    ids = []
    for i in range(30):
        status, doc = submit(lb, line(i, max_tokens=2))
        assert status == 202, doc
        ids.append(doc["id"])

    def views():
        return [http_json("GET", f"{lb.url}/v1/lb/jobs/{j}")[1] for j in ids]

    poll(lambda: all(v["status"] in ("completed", "failed") for v in views()), timeout=60,
         what="all 30 jobs to finish")
    done = views()
    assert [v["status"] for v in done] == ["completed"] * 30, [v.get("error") for v in done]
    assert all(v["attempts"] == 1 for v in done)
