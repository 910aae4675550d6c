"""Durable batch jobs (issue 5): NIW work that survives an `lb` restart.

What an OpenAI Batch-API user expects, one request at a time:
- `POST /v1/lb/jobs` with a Batch-API line `{"custom_id", "method": "POST", "url":
  "/v1/chat/completions" | "/v1/completions", "body": {...}}`, or any chat/completions call
  with `x-lb-durable: 1` → `202 Accepted`, the job object and `Location: /v1/lb/jobs/{id}`;
- `GET /v1/lb/jobs/{id}` → `status` queued | running | completed | failed, and when done the
  `response` (`status_code`, `body`: the answer the endpoint gave) or the `error`.

A job is acknowledged only after its `submit` record is fsynced to `[deferred] persist_dir`
/`jobs.jsonl`; its `finish` record (with the response body) likewise. On start the journal is
replayed and compacted (finished jobs older than `job_retention_s` are dropped), and every
unfinished job is queued again. A job waits in the deferred queue like any NIW request —
released by spare KV capacity or its deadline — and then takes the normal path through the
LB queue (`Proxy.call`). A `flock` on `jobs.lock` keeps a second LB off the same directory.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import orjson
from aiohttp import web
from prometheus_client import Counter, Gauge

from lb.core.facts import H_TIER, BadRequest, build_facts
from lb.core.jobs import (IDENTITY_FIELDS, JOB_URLS, QUEUED, RUNNING, Job, check_body, droppable, expired,
                          finish_record, parse_submission, records_of, refusal, replay, submit_record)
from lb.core.types import RequestFacts, Tier
from lb.daemon.errors import LBError

log = logging.getLogger("lb.jobs")

H_DURABLE = "x-lb-durable"
JOURNAL = "jobs.jsonl"
RETRY_STATUSES = (429, 502, 503, 504)  # the region was busy or failing: try again later
MAX_ATTEMPTS = 5
COMPACT_EVERY_S = 3600.0


class Journal:
    """Append-only JSON lines, each fsynced; compaction writes a new file and renames it."""

    def __init__(self, directory: str):
        self.dir = Path(directory)
        self.path = self.dir / JOURNAL
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._lock = asyncio.Lock()
        self.size = 0  # bytes in the file now (deferred.max_journal_bytes triggers a compaction)

    def open(self) -> list[dict]:
        """Lock the directory and read what is there (a torn last line is skipped)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / "jobs.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"deferred.persist_dir {self.dir} is in use by another lb process") from None
        records = []
        if self.path.exists():
            data = self.path.read_bytes()
            self.size = len(data)
            for n, line in enumerate(data.splitlines(), 1):
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError:
                    log.warning("%s line %d is not JSON (torn by a crash?): skipped", self.path, n)
        return records

    def rewrite(self, records: list[dict]) -> None:
        """Replace the journal with `records`, atomically (write, fsync, rename, fsync dir)."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = b"".join(orjson.dumps(r) + b"\n" for r in records)
            os.write(fd, data)
            os.fsync(fd)
            self.size = len(data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._fsync_dir()
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    async def compact(self, records: list[dict]) -> None:
        async with self._lock:
            await asyncio.to_thread(self.rewrite, records)

    async def append(self, record: dict) -> None:
        line = orjson.dumps(record) + b"\n"
        async with self._lock:  # one writer at a time, in write order
            await asyncio.to_thread(self._write, line)

    def _write(self, line: bytes) -> None:
        os.write(self._fd, line)
        os.fsync(self._fd)
        self.size += len(line)

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None


class Jobs:
    def __init__(self, cfg, proxy, metrics):
        self.cfg = cfg
        self.retention_s = cfg.deferred.job_retention_s
        self.proxy = proxy
        self.journal = Journal(cfg.deferred.persist_dir) if cfg.deferred.persist_dir else None
        self.jobs: dict[str, Job] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._closing = False
        self._compacted_at = 0.0
        r = metrics.registry
        self.submitted = Counter("lb_jobs_submitted", "Durable batch jobs accepted", registry=r)
        self.finished = Counter("lb_jobs_finished", "Durable batch jobs finished", ["status"], registry=r)
        Gauge("lb_jobs_unfinished", "Durable batch jobs queued or running",
              registry=r).set_function(lambda: len(self._tasks))

    @property
    def enabled(self) -> bool:
        return self.journal is not None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.enabled:
            return
        records = await asyncio.to_thread(self.journal.open)
        self.jobs = replay(records)
        for job in self.jobs.values():
            job.size = _size(job)
        await self._compact()
        pending = [j for j in self.jobs.values() if not j.done]
        for job in pending:
            self._launch(job)
        log.info("jobs: %d in %s, %d to run", len(self.jobs), self.journal.path, len(pending))

    async def close(self) -> None:
        """Stop running jobs; unfinished ones stay in the journal and run after the restart."""
        self._closing = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.journal is not None:
            self.journal.close()

    # -- HTTP ----------------------------------------------------------------------------------
    async def handle_post(self, request: web.Request) -> web.Response:
        """`POST /v1/lb/jobs` with a Batch-API request line."""
        rid = uuid.uuid4().hex
        try:
            self._check_enabled()
            try:
                doc = orjson.loads(await request.read())
            except orjson.JSONDecodeError as e:
                raise LBError(400, f"request body is not valid JSON: {e}", code="invalid_json")
            except web.HTTPRequestEntityTooLarge:
                raise LBError(413, "request body is too large", code="body_too_large")
            try:
                url, body, custom_id = parse_submission(doc)
                facts = build_facts(JOB_URLS[url], body, request.headers, rid, time.monotonic(),
                                    self.proxy.registry.is_adapter)
            except BadRequest as e:
                raise LBError(400, str(e), code="invalid_request", param=e.param)
            proxy = self.proxy
            fairness = proxy.dispatcher.fairness
            facts = fairness.identify(request.headers, body, facts)
            if facts.model and not proxy.registry.knows_model(facts.model):
                raise LBError(404, f"The model `{facts.model}` does not exist; GET /v1/models lists the served ones",
                              code="model_not_found", param="model")
            proxy.dispatcher.scheduler.recognize(facts, time.monotonic())  # as the proxy: OIT sees continuations
            await fairness.check_throttle(facts, time.monotonic(), len(proxy.dispatcher.queue),
                                          lambda: any(proxy.dispatcher.available(r.view) for r in proxy.registry.active()))
            return await self.accept(request, url, body, facts, custom_id)
        except LBError as e:
            return e.response(rid)

    async def accept(self, request: web.Request, url: str, body: dict, facts: RequestFacts,
                     custom_id: str | None = None) -> web.Response:
        """Journal the request as a job and answer 202 (also the `x-lb-durable: 1` path)."""
        self._check_enabled()
        if url not in JOB_URLS:
            raise LBError(400, f"durable jobs take {' or '.join(JOB_URLS)}", code="invalid_request", param=H_DURABLE)
        if request.headers.get(H_TIER) is not None and facts.tier is not Tier.NIW:
            raise LBError(400, "durable jobs are batch work: x-lb-tier must be niw or unset", code="invalid_request",
                          param=H_TIER)
        try:
            check_body(body)
        except BadRequest as e:
            raise LBError(400, str(e), code="invalid_request", param=e.param)
        job = Job(id="job_" + uuid.uuid4().hex, created_at=time.time(), url=url, body=body, custom_id=custom_id,
                  identity={k: getattr(facts, k) for k in IDENTITY_FIELDS})
        job.size = _size(job)
        self._make_room(job)  # 413/429 over a bound (lb.core.jobs.refusal); finished ones may go
        self.jobs[job.id] = job  # counted from now: concurrent submissions see it
        try:
            await self.journal.append(submit_record(job))  # durable before it is acknowledged
        except BaseException:
            self.jobs.pop(job.id, None)
            raise
        await self._bound_journal()
        self.submitted.inc()
        self._launch(job)
        location = f"/v1/lb/jobs/{job.id}"
        return web.Response(status=202, body=orjson.dumps(job.view()), content_type="application/json",
                            headers={"Location": location, "X-Request-Id": facts.request_id})

    async def handle_get(self, request: web.Request) -> web.Response:
        """`GET /v1/lb/jobs/{id}`: another tenant's job (with API keys configured) is a 404 too."""
        job_id = request.match_info["id"]
        job = self.jobs.get(job_id)
        if job is not None and self.cfg.identity.api_keys:
            fairness = self.proxy.dispatcher.fairness
            who = fairness.identify(request.headers, {}, RequestFacts(request_id="", model=""))
            if who.user != job.identity.get("user"):
                job = None
        if job is None:  # LBError answers through lb.daemon.errors.answer_errors
            raise LBError(404, f"no job {job_id!r}", code="job_not_found", param="id")
        return web.Response(body=orjson.dumps(job.view()), content_type="application/json")

    def durable(self, request: web.Request) -> bool:
        """Whether a chat/completions call asks to become a durable job (`x-lb-durable`)."""
        value = request.headers.get(H_DURABLE)
        if value is None:
            return False
        v = value.strip().lower()
        if v in ("1", "true", "yes"):
            return True
        if v in ("0", "false", "no"):
            return False
        raise LBError(400, f"{H_DURABLE} must be 1 or 0, got {value!r}", code="invalid_request", param=H_DURABLE)

    def _make_room(self, job: Job) -> None:
        d = self.cfg.deferred
        no = refusal(self.jobs.values(), job.tenant, job.size, d)
        if no is not None:
            status, code, message = no
            raise LBError(status, message, code=code, retry_after=None if status == 413 else 5)
        for old in droppable(self.jobs.values(), job.size, d):
            del self.jobs[old.id]  # finished, the oldest: its result goes before its retention ends

    async def _bound_journal(self) -> None:
        """Compact once the journal outgrows deferred.max_journal_bytes (it then holds only the
        jobs kept, which the job bounds cap)."""
        limit = self.cfg.deferred.max_journal_bytes
        if self.journal.size > limit:
            await self._compact()
            if self.journal.size > limit:
                log.warning("jobs journal is %d bytes after compaction, over deferred.max_journal_bytes = %d",
                            self.journal.size, limit)

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LBError(400, "durable batch jobs are off: set [deferred] persist_dir", code="jobs_disabled")

    # -- running -------------------------------------------------------------------------------
    def _launch(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _t, jid=job.id: self._tasks.pop(jid, None))

    def _facts(self, job: Job) -> RequestFacts:
        # Deadlines run from submission, across restarts: wall age mapped onto this monotonic clock.
        arrival = time.monotonic() - max(0.0, time.time() - job.created_at)
        facts = build_facts(job.route, job.body, {}, job.id, arrival, self.proxy.registry.is_adapter)
        return replace(facts, tier=Tier.NIW, **job.identity)

    async def _run(self, job: Job) -> None:
        try:
            status, body = await self._attempts(job)
        except asyncio.CancelledError:
            if job.status == RUNNING:
                job.status = QUEUED  # cut by shutdown: runs again after the restart
            raise
        except LBError as e:
            if self._closing:
                return
            status, body = e.status, orjson.loads(e.response().body)
        except Exception as e:  # a bug must not leave the job "running" forever
            log.exception("job %s failed in the LB", job.id)
            status, body = 500, {"error": {"message": f"lb: {type(e).__name__}", "type": "server_error",
                                           "param": None, "code": "internal_error"}}
        job.finish(status, body, time.time())
        job.size = _size(job)
        for old in droppable(self.jobs.values(), 0, self.cfg.deferred, count=0):  # its response counts too
            if old is not job:
                del self.jobs[old.id]
        self.finished.labels(job.status).inc()
        try:
            await self.journal.append(finish_record(job))
        except OSError as e:
            log.error("job %s finished but its result could not be journalled: %s", job.id, e)
        if time.monotonic() - self._compacted_at > COMPACT_EVERY_S:
            await self._compact()
        else:
            await self._bound_journal()

    async def _attempts(self, job: Job) -> tuple[int, object]:
        """Run the job until it has an answer to keep. Waiting for room in the deferred queue
        costs no try: the job was acknowledged as durable, so the LB's own backlog never fails
        it; only an answer from the region (busy or failing, RETRY_STATUSES) uses one up."""
        attempt = 0
        while True:
            try:
                facts = self._facts(job)
            except BadRequest as e:
                return 400, orjson.loads(LBError(400, str(e), code="invalid_request", param=e.param).response().body)
            try:
                await self.proxy.gate.hold(facts)  # the deferred queue: spare capacity or the deadline
            except LBError as e:
                if self._closing or e.code != "deferred_full":
                    raise
                await asyncio.sleep(e.retry_after or 1)  # wait for room
                continue
            attempt += 1
            job.status, job.started_at = RUNNING, time.time()
            job.attempts += 1
            resp = await self.proxy.call(job.route, job.body, facts)
            if not isinstance(resp, web.Response):  # a stream nobody asked for
                return 502, {"error": {"message": "upstream streamed a batch job's answer", "type": "server_error",
                                       "param": None, "code": "upstream_streamed"}}
            if resp.status in RETRY_STATUSES and attempt < MAX_ATTEMPTS and not self._closing:
                job.status = QUEUED
                retry_after = resp.headers.get("Retry-After")
                await asyncio.sleep(float(retry_after) if retry_after else min(60.0, 2.0 ** attempt))
                continue
            return resp.status, _json_or_text(resp.body)

    async def _compact(self) -> None:
        now = time.time()
        for job_id in [j.id for j in self.jobs.values() if expired(j, now, self.retention_s)]:
            del self.jobs[job_id]
        await self.journal.compact(records_of(self.jobs.values()))
        self._compacted_at = time.monotonic()


def _size(job: Job) -> int:
    """Bytes a job holds: its request body, and its response once it has one."""
    return len(orjson.dumps(job.body)) + (len(orjson.dumps(job.response)) if job.response else 0)


def _json_or_text(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


def add_routes(routes: web.RouteTableDef, jobs_of) -> None:
    """`jobs_of(request)` gives the running LB's `Jobs`."""

    @routes.post("/v1/lb/jobs")
    async def post_job(request: web.Request) -> web.Response:
        return await jobs_of(request).handle_post(request)

    @routes.get("/v1/lb/jobs/{id}")
    async def get_job(request: web.Request) -> web.Response:
        return await jobs_of(request).handle_get(request)
