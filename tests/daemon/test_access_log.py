"""The access log: one JSON line per request, the lines of one loop iteration in one write
at its end, never more than PIPE_BUF bytes per write (so writers sharing a pipe never split a
line), and nothing kept back past the iteration or a flush."""
import asyncio
import fcntl
import os
import select

import orjson

from lb.daemon.proxy import AccessLog, Outcome


def _nonblocking_pipe() -> tuple[int, int]:
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_NONBLOCK)
    return r, w


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_lines_of_one_iteration_go_out_together_at_its_end_each_whole():
    r, w = _nonblocking_pipe()
    log = AccessLog(fd=w)
    n = 100  # ~30 kB of lines: several PIPE_BUF-sized writes

    async def main() -> tuple[bytes, bytes]:
        for i in range(n):
            log.write(Outcome(request_id=f"req-{i:04d}", route="chat", status=200, model="m" * 100))
        during = _read_all(r)  # still inside the iteration: at most the full PIPE_BUF batches
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return during, _read_all(r)

    during, after = asyncio.run(main())
    os.close(r), os.close(w)
    # inside the iteration only full batches went out (bounded by PIPE_BUF, whole lines); the
    # rest came at its end, and nothing was lost or reordered
    assert during and during.endswith(b"\n") and after and after.endswith(b"\n")
    assert len(during) < n * len(during.splitlines()[0])
    lines = (during + after).splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == [f"req-{i:04d}" for i in range(n)]
    assert len(after) <= select.PIPE_BUF


def test_a_flush_writes_what_waits_and_without_a_loop_a_line_goes_out_at_once():
    r, w = _nonblocking_pipe()
    log = AccessLog(fd=w)
    log.write(Outcome(request_id="no-loop", route="chat"))  # no running loop: written now
    assert orjson.loads(_read_all(r))["request_id"] == "no-loop"

    async def main() -> bytes:
        log.write(Outcome(request_id="at-shutdown", route="chat"))
        assert _read_all(r) == b""  # waits for the iteration's end...
        log.flush()  # ...unless the server flushes it on its way out
        return _read_all(r)

    assert orjson.loads(asyncio.run(main()))["request_id"] == "at-shutdown"
    os.close(r), os.close(w)
