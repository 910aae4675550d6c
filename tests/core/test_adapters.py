"""LoRA adapters (lb.core.adapters): a request for an adapter goes only where its adapter runs
or a batch slot is free, waits in the LB's queue otherwise without blocking the requests behind
it, and its prompt's chain is its adapter's own."""
from __future__ import annotations

from lb.core.adapters import Adapters
from lb.core.facts import build_facts
from lb.core.loadparse import lora_limit, parse_vllm_metrics
from lb.core.prefix import request_chain
from lb.core.scheduler import Kind
from lb.core.types import QueueEntry, ReplicaView, RequestFacts
from tests.core.test_scheduler import NOW, rep, sched, seq


def lora_entry(rid: str, adapter: str | None) -> QueueEntry:
    return QueueEntry(RequestFacts(rid, adapter or "m", prompt_tokens=100, max_tokens=16, adapter=adapter),
                      enqueued_at=NOW, seq=next(seq))


def lora_rep(rid: str, **kw):
    return rep(rid, models={"m", "p", "q", "s"}, adapters=frozenset({"p", "q", "s"}), max_loras=1, **kw)


def outcome(s, targets) -> dict[str, str | None]:
    return {p.entry.facts.request_id: p.target_id if p.kind is Kind.REPLICA else p.kind.name
            for p in s.schedule(NOW, targets)}


def test_an_adapter_fits_where_it_runs_or_a_slot_is_free():
    a = Adapters()
    view = ReplicaView(id="x", url="", max_loras=2, running_adapters=frozenset({"p"}))
    assert a.fits(view, "p") and a.fits(view, "q")  # p runs; one slot of two free
    a.placed("r1", "x", "q")  # ours, not yet in a probe
    assert a.fits(view, "q") and not a.fits(view, "s")
    assert a.fits(view, None)  # the base model takes no slot
    assert a.fits(ReplicaView(id="y", url=""), "s")  # no limit known: no limit
    a.ended("r1")
    assert a.fits(view, "s") and a.on == {}


def test_another_instances_requests_end_here_once_its_log_forgets_them_and_a_removed_replica_runs_none():
    a = Adapters()
    view = ReplicaView(id="x", url="", max_loras=2, running_adapters=frozenset({"q"}))
    a.placed("ours", "x", "p")
    a.placed("theirs", "x", "s", remote=True)
    assert a.count(view) == 3 and not a.fits(view, "t")
    a.prune_remote("x", {"theirs"})  # still in the log: kept
    assert a.count(view) == 3
    a.prune_remote("x", set())  # its end never heard, and the log forgot it
    assert a.count(view) == 2 and a.on == {"x": {"p": 1}}
    a.forget("x")
    assert a.on == {} and a.count(view) == 1  # what the last probe saw stays until the next


def test_a_request_whose_adapter_fits_nowhere_waits_here_without_blocking_the_next():
    s = sched(push_credit=8)
    targets = [lora_rep("a"), lora_rep("b")]
    for rid, adapter in (("r0", "p"), ("r1", "q")):
        s.admit(lora_entry(rid, adapter), NOW)
    first = outcome(s, targets)
    assert sorted(first.values()) == ["a", "b"]  # one adapter a replica
    p_on = first["r0"]
    s.admit(lora_entry("r2", "s"), NOW)  # a third adapter: no slot anywhere
    s.admit(lora_entry("r3", "p"), NOW)  # behind it, p's own: beside the p running
    s.admit(lora_entry("r4", None), NOW)  # and the base model: anywhere
    second = outcome(s, targets)
    assert "r2" not in second and s.waiting("s") == 1  # still queued here
    assert second["r3"] == p_on and second["r4"] in ("a", "b")
    s.ended("r1")  # q ended: its replica's slot is free for s
    q_on = first["r1"]
    targets[[t.view.id for t in targets].index(q_on)].view.pending = 0
    assert outcome(s, targets) == {"r2": q_on}


def test_a_probe_shows_the_adapters_another_client_runs():
    s = sched(push_credit=8)
    busy = lora_rep("a", running_adapters=frozenset({"other"}))
    s.admit(lora_entry("r0", "p"), NOW)
    assert outcome(s, [busy, lora_rep("b")]) == {"r0": "b"}


def test_an_adapters_prompt_is_its_own_in_the_trie():
    text = "You are a helpful assistant. " * 40
    base = RequestFacts("r", "m", prompt=text)
    one = RequestFacts("r", "p", prompt=text, adapter="p")
    other = RequestFacts("r", "q", prompt=text, adapter="q")
    chains = [request_chain(f) for f in (base, one, other)]
    assert len({c[0] for c in chains}) == 3  # no block of one matches another's
    assert request_chain(RequestFacts("r2", "p", prompt=text, adapter="p")) == chains[1]
    isolated = request_chain(RequestFacts("r3", "p", prompt=text, adapter="p", user="t"), isolate_tenants=True)
    assert isolated[0] not in {c[0] for c in chains}


def test_the_adapter_is_the_model_a_replica_lists_as_one():
    body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
    assert build_facts("chat", body, {}, "r", NOW, {"p"}.__contains__).adapter == "p"
    assert build_facts("chat", {**body, "model": "m"}, {}, "r", NOW, {"p"}.__contains__).adapter is None
    assert build_facts("chat", body, {}, "r", NOW).adapter is None
    generate = {"text": "hi", "lora_path": "q"}
    assert build_facts("generate", generate, {}, "r", NOW).adapter == "q"


def test_vllms_lora_info_the_newest_series_is_the_present():
    page = b"""vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters="p,q",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="q",waiting_lora_adapters="s"} 1.7000001e+09
"""
    load = parse_vllm_metrics(page)
    assert load.running_adapters == frozenset({"q"}) and load.max_loras == 4
    plain = parse_vllm_metrics(b'vllm:num_requests_waiting{engine="0"} 0.0\n')
    assert plain.running_adapters is None and plain.max_loras is None


def test_sglang_server_args_say_how_many_adapters_a_batch_runs():
    assert lora_limit(b'{"enable_lora": true, "max_loras_per_batch": 8}') == 8
    assert lora_limit(b'{"lora_paths": {"p": "/a/p"}, "max_loras_per_batch": 2}') == 2
    assert lora_limit(b'{"lora_paths": null, "max_loras_per_batch": 8}') is None  # serves none
    assert lora_limit(b'{"enable_lora": true, "max_loras_per_batch": 0}') is None


def test_a_real_vllm_pages_lora_info_names_none_running_once_its_adapter_ended():
    """vLLM 0.32 (CPU build) serving two adapters with `--max-loras 1`, its /metrics captured
    after one request for `a1` ended: the series it set while `a1` ran stays beside the newer one."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "data" / "vllm-0.32-cpu-lora-metrics.txt").read_bytes()
    load = parse_vllm_metrics(page)
    assert load.max_loras == 1 and load.running_adapters == frozenset()
    assert page.count(b"vllm:lora_requests_info{") == 2
