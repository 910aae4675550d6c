"""Durable batch jobs: what a job is, how its journal replays, and what a client sees.

A job is one OpenAI Batch-API request line — `{"custom_id", "method", "url", "body"}` —
accepted at once (202) and served later as NIW work. The daemon journals two records per
job, each appended and fsynced before it is acknowledged: `submit` (the whole request) and
`finish` (the response). Replaying the journal after a restart gives back every job; one
that was submitted but never finished is queued again (at-least-once: a job cut mid-run is
run again). Compaction rewrites the journal without jobs past their retention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .facts import BadRequest

QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"
# URL → the proxy's route name (the same endpoints a client can call directly).
JOB_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Identity fields a job keeps (resolved at submission, so no credential is ever journalled).
IDENTITY_FIELDS = ("user", "app", "interaction_id", "interaction_stage", "final_call")


@dataclass
class Job:
    id: str
    created_at: float  # wall clock (survives restarts; monotonic time does not)
    url: str
    body: dict
    identity: dict = field(default_factory=dict)
    custom_id: str | None = None
    status: str = QUEUED
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    response: dict | None = None  # {"status_code", "request_id", "body"}
    size: int = 0  # bytes it holds (request, and response once finished): what the job bounds count

    @property
    def tenant(self) -> str:
        return self.identity.get("user") or ""

    @property
    def route(self) -> str:
        return JOB_URLS[self.url]

    @property
    def done(self) -> bool:
        return self.status in (COMPLETED, FAILED)

    def finish(self, status_code: int, body: object, now: float) -> None:
        self.status = COMPLETED if 200 <= status_code < 300 else FAILED
        self.finished_at = now
        self.response = {"status_code": status_code, "request_id": self.id, "body": body}

    def view(self) -> dict:
        """The job as `GET /v1/lb/jobs/{id}` shows it (shaped like a Batch-API output line)."""
        error = None
        if self.status == FAILED and self.response:
            body = self.response["body"]
            error = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else {
                "message": f"upstream answered {self.response['status_code']}", "code": None}
        return {"id": self.id, "object": "lb.job", "status": self.status, "custom_id": self.custom_id,
                "url": self.url, "created_at": int(self.created_at),
                "started_at": None if self.started_at is None else int(self.started_at),
                "completed_at": None if self.finished_at is None else int(self.finished_at),
                "attempts": self.attempts, "response": self.response if self.done else None, "error": error}


def parse_submission(doc: object) -> tuple[str, dict, str | None]:
    """A Batch-API request line → (url, body, custom_id). Raises BadRequest naming the field."""
    if not isinstance(doc, dict):
        raise BadRequest("a job must be a JSON object like a Batch-API line: {\"url\", \"body\"}")
    unknown = set(doc) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise BadRequest(f"unknown job fields {sorted(unknown)}", sorted(unknown)[0])
    if doc.get("method", "POST") != "POST":
        raise BadRequest("`method` must be POST", "method")
    url = doc.get("url")
    if url not in JOB_URLS:
        raise BadRequest(f"`url` must be one of {sorted(JOB_URLS)}", "url")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise BadRequest("`body` must be the request object the endpoint takes", "body")
    check_body(body)
    custom_id = doc.get("custom_id")
    if custom_id is not None and (not isinstance(custom_id, str) or len(custom_id) > 512):
        raise BadRequest("`custom_id` must be a string of at most 512 characters", "custom_id")
    return url, body, custom_id


def check_body(body: dict) -> None:
    """Batch work is answered whole: a streamed job has nobody to stream to."""
    if body.get("stream"):
        raise BadRequest("batch jobs cannot stream: leave `stream` unset or false", "stream")


def submit_record(job: Job) -> dict:
    return {"op": "submit", "id": job.id, "created_at": job.created_at, "url": job.url, "body": job.body,
            "identity": job.identity, "custom_id": job.custom_id}


def finish_record(job: Job) -> dict:
    return {"op": "finish", "id": job.id, "at": job.finished_at, "response": job.response}


def replay(records: Iterable[dict]) -> dict[str, Job]:
    """Jobs from journal records in write order; unknown ops and orphans are skipped."""
    jobs: dict[str, Job] = {}
    for r in records:
        op = r.get("op")
        if op == "submit" and r.get("url") in JOB_URLS:
            jobs[r["id"]] = Job(id=r["id"], created_at=r["created_at"], url=r["url"], body=r["body"],
                                identity=r.get("identity") or {}, custom_id=r.get("custom_id"))
        elif op == "finish" and r.get("id") in jobs:
            job = jobs[r["id"]]
            resp = r.get("response") or {}
            job.finish(int(resp.get("status_code", 500)), resp.get("body"), r.get("at") or job.created_at)
    return jobs


def records_of(jobs: Iterable[Job]) -> list[dict]:
    """The shortest journal that replays to `jobs` (compaction writes this)."""
    out: list[dict] = []
    for job in jobs:
        out.append(submit_record(job))
        if job.done:
            out.append(finish_record(job))
    return out


def refusal(jobs: Iterable[Job], tenant: str, size: int, cfg) -> tuple[int, str, str] | None:
    """Why a new job of `size` bytes from `tenant` cannot be held, as (status, code, message),
    or None. `cfg`: the [deferred] bounds. Finished jobs do not count: they can be dropped
    (`droppable`) to make room, a tenant's unfinished work cannot."""
    if size > cfg.max_job_bytes_per_tenant:
        return 413, "job_too_large", (f"a job of {size} bytes exceeds deferred.max_job_bytes_per_tenant = "
                                      f"{cfg.max_job_bytes_per_tenant}")
    count = nbytes = total = total_bytes = 0
    for j in jobs:
        if j.done:
            continue
        total += 1
        total_bytes += j.size
        if j.tenant == tenant:
            count += 1
            nbytes += j.size
    if count + 1 > cfg.max_jobs_per_tenant or nbytes + size > cfg.max_job_bytes_per_tenant:
        return 429, "too_many_jobs", (f"this tenant has {count} unfinished jobs ({nbytes} bytes); "
                                      f"deferred.max_jobs_per_tenant = {cfg.max_jobs_per_tenant}, "
                                      f"max_job_bytes_per_tenant = {cfg.max_job_bytes_per_tenant}: wait for some to finish")
    if total + 1 > cfg.max_jobs or total_bytes + size > cfg.max_job_bytes:
        return 429, "jobs_full", (f"{total} unfinished jobs ({total_bytes} bytes) fill deferred.max_jobs = "
                                  f"{cfg.max_jobs} / max_job_bytes = {cfg.max_job_bytes}: retry later")
    return None


def droppable(jobs: Iterable[Job], size: int, cfg, count: int = 1) -> list[Job]:
    """Finished jobs to forget, oldest first, so that `count` more holding `size` bytes fit the totals."""
    held = list(jobs)
    over_count = len(held) + count - cfg.max_jobs
    over_bytes = sum(j.size for j in held) + size - cfg.max_job_bytes
    out = []
    for j in sorted((j for j in held if j.done), key=lambda j: j.finished_at or 0.0):
        if over_count <= 0 and over_bytes <= 0:
            break
        out.append(j)
        over_count -= 1
        over_bytes -= j.size
    return out


def expired(job: Job, now: float, retention_s: float) -> bool:
    """A finished job is kept for `retention_s` after it finished, then forgotten."""
    return job.done and job.finished_at is not None and now - job.finished_at > retention_s
