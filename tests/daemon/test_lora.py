"""LoRA adapters through a real `lb` over two emulators on vLLM's face, each serving three
adapters with a batch of one adapter (`--max-loras 1`), probed 10 s apart: between probes only
`lb`'s own count of the adapters it has under way where stands between a request and an engine
that would skip it. `lb` learns which models are adapters from `/v1/models` (their cards name a
parent) and how many a batch runs from `vllm:lora_requests_info`. While lora-0 and lora-1 each
decode on a replica, a request for lora-2 waits in `lb`'s queue and in neither engine's, a
request for lora-0 still runs at once beside its own, and lora-2's is answered once a slot frees.
Pushed on as before, lora-2's request waited in an engine."""
from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from openai import NotFoundError, OpenAI

from tests.daemon.conftest import needs_emulator, start_emulator, start_lb
from tests.daemon.test_parallel_samples import SLOW_PROBES, lb_queue
from tests.procs import poll, scrape_metrics

pytestmark = needs_emulator

MSG = [{"role": "user", "content": "a question for a fine-tune"}]


def post(url: str, body: dict) -> int:
    """POST JSON to an engine's control route, which answers plain text as vLLM's does."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        return r.status


def decode(client: OpenAI, adapter: str):
    """A long streamed answer of `adapter`, decoding by the time this returns: its chunks to come."""
    chunks = iter(client.chat.completions.create(model=adapter, messages=MSG, max_tokens=300, stream=True,
                                                 extra_body={"ignore_eos": True}))
    next(chunks)
    return chunks


def engine_load(url: str) -> tuple[int, int]:
    with urllib.request.urlopen(url + "/get_load", timeout=5) as r:
        ranks = json.loads(r.read())
    return sum(x["num_reqs"] - x["num_waiting_reqs"] for x in ranks), sum(x["num_waiting_reqs"] for x in ranks)


def test_a_request_for_an_adapter_no_batch_can_take_waits_in_lb_not_in_an_engine(procs, tmp_path):
    emus = []
    for i in range(2):
        proc, url = start_emulator("--speed", "1", "--lora-adapters", "3", "--max-loras", "1", name=f"emu{i}")
        procs.append(proc)
        emus.append(url)
    cfg = tmp_path / "lb.toml"
    cfg.write_text("".join(f'[[replicas]]\nurl = "{u}"\nengine = "vllm"\n\n' for u in emus) + SLOW_PROBES)
    lb = start_lb(config=cfg)
    procs.append(lb.proc)
    client = OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=60)
    listed = [(m.id, (m.model_extra or {}).get("parent")) for m in client.models.list().data]
    assert listed == [("m", None), ("lora-0", "m"), ("lora-1", "m"), ("lora-2", "m")]  # the base model first

    long_ones = [decode(client, "lora-0"), decode(client, "lora-1")]
    assert sorted(engine_load(u) for u in emus) == [(1, 0), (1, 0)]  # one adapter on each replica
    gauges = scrape_metrics(lb.url)
    assert sorted(s.value for s in gauges["lb_replica_max_loras"]) == [1, 1]  # from vllm:lora_requests_info
    assert sorted(s.value for s in gauges["lb_replica_lora_adapters"]) == [1, 1]  # each batch's one slot taken
    answers: dict[str, int] = {}

    def short(adapter: str) -> None:
        answer = client.chat.completions.create(model=adapter, messages=MSG, max_tokens=4)
        answers[adapter] = len(answer.choices)

    late = threading.Thread(target=short, args=("lora-2",))
    late.start()
    poll(lambda: lb_queue(lb.url) == 1, what="lora-2's request waiting in lb's queue")
    assert [w for _, w in map(engine_load, emus)] == [0, 0]  # in no engine's queue
    short("lora-0")  # behind it in lb's queue, lora-0's own request runs beside lora-0 at once
    assert answers == {"lora-0": 1} and lb_queue(lb.url) == 1
    for chunks in long_ones:
        for _ in chunks:
            pass
    late.join(timeout=60)
    assert answers == {"lora-0": 1, "lora-2": 1}  # once a slot freed, lora-2's was answered


def test_an_adapter_loaded_at_run_time_is_served_once_its_replicas_models_are_read_again(procs, tmp_path):
    proc, emu = start_emulator("--speed", "4", "--max-loras", "2")  # LoRA on, no adapter yet
    procs.append(proc)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[[replicas]]\nurl = "{emu}"\nengine = "vllm"\n\n[probes]\nmodels_refresh_s = 0.3\n')
    lb = start_lb(config=cfg)
    procs.append(lb.proc)
    client = OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def served() -> set[str]:
        return {m.id for m in client.models.list().data}

    with pytest.raises(NotFoundError) as err:
        client.chat.completions.create(model="fresh", messages=MSG, max_tokens=2)
    assert err.value.body["param"] == "model"
    assert post(emu + "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": "/adapters/fresh"}) == 200
    poll(lambda: "fresh" in served(), what="the adapter loaded at run time in lb's /v1/models")
    assert client.chat.completions.create(model="fresh", messages=MSG, max_tokens=2).choices
    assert post(emu + "/v1/unload_lora_adapter", {"lora_name": "fresh"}) == 200
    poll(lambda: served() == {"m"}, what="the adapter gone from lb's /v1/models once unloaded")
