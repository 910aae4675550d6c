"""Parallel sampling (the API's `n`) through a real `lb` over an emulator on SGLang's face: the
engine runs each of a request's n samples as a request of its own, so a push of n = 4 fills a
batch of four. `lb` counts each sample as an unseen push (`lb.core.pushing.record_push`): with
the probes far apart, the requests sent while the four samples decode wait in `lb`'s queue, not
in the engine's. Counted as one push, the three were sent on to wait there."""
from __future__ import annotations

import json
import threading
import urllib.request

from openai import OpenAI

from tests.daemon.conftest import needs_emulator, start_lb_with_emulator
from tests.procs import poll

pytestmark = needs_emulator

SAMPLES, ANSWER_TOKENS, OTHERS = 4, 400, 3
# Probes 10 s apart (and no early one within 5 s of a push): between two of them only `lb`'s own
# count of what it pushed stands between the batch cap and a push that would wait in the engine
SLOW_PROBES = "[probes]\ninterval_s = 10.0\nearly_reprobe_s = 5.0\n"


def engine_waiting(url: str) -> int:
    with urllib.request.urlopen(url + "/get_load", timeout=5) as r:
        return sum(x["num_waiting_reqs"] for x in json.loads(r.read()))


def lb_queue(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("lb_queue_length "):
                return int(float(line.split()[1]))
    return 0


def test_each_parallel_sample_spends_a_push_so_the_next_requests_wait_in_lb(procs, tmp_path):
    lb, (emu_url,) = start_lb_with_emulator(procs, tmp_path, SLOW_PROBES, "--max-running", str(SAMPLES),
                                            "--speed", "1")
    client = OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "four takes on tides"}], n=SAMPLES,
        max_tokens=ANSWER_TOKENS, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # the samples decode: the engine's batch of four is full
    finished: dict[int, str] = {}
    for choice in first.choices:
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason

    statuses: list[int] = []

    def other(i: int) -> None:
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"short {i}"}],
                                                max_tokens=8)
        statuses.append(len(answer.choices))

    threads = [threading.Thread(target=other, args=(i,)) for i in range(OTHERS)]
    for t in threads:
        t.start()
    poll(lambda: lb_queue(lb.url) == OTHERS, what="the other requests waiting in lb's queue")
    assert engine_waiting(emu_url) == 0  # none was sent on to wait behind the full batch
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {i: "length" for i in range(SAMPLES)}  # every sample's answer came through
    for t in threads:
        t.join(timeout=60)
    assert statuses == [1] * OTHERS  # and then the others were answered
