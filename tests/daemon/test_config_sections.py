"""`lb check-config`: every section of the effective config printed, and a bad value in any
section refused at load naming the key and the fix (unknown key, wrong type, bad choice, bad
URL). Load is also what SIGHUP runs, so a reload is refused the same way."""
from __future__ import annotations

import subprocess
import tomllib
from dataclasses import fields

import pytest

from lb.daemon.config import Config, ConfigError, from_dict, load, to_toml
from tests.procs import REPO, lb

BAD = [
    ({"discovery": [{"kind": "consul"}]}, "discovery[0].kind: 'consul' is not allowed; use one of: kubernetes, dns"),
    ({"discovery": [{"kind": "kubernetes", "selectr": "a=b"}]}, "discovery[0].selectr: unknown key; did you mean `selector`?"),
    ({"discovery": [{"kind": "dns", "name": "x", "engine": "tgi"}]}, "discovery[0].engine: 'tgi' is not allowed"),
    ({"server": {"prot": 1}}, "server.prot: unknown key; did you mean `port`?"),
    ({"server": {"port": "80"}}, "server.port: expected an integer, got '80'"),
    ({"server": {"port": 70000}}, "server.port: 70000 is not a TCP port"),
    ({"upstream": {"retry": 1}}, "upstream.retry: unknown key; did you mean `retries`?"),
    ({"upstream": {"retries": "2"}}, "upstream.retries: expected an integer"),
    ({"probes": {"timeout_s": "slow"}}, "probes.timeout_s: expected a number"),
    ({"proxy": {"forward_header": []}}, "proxy.forward_header: unknown key; did you mean `forward_headers`?"),
    ({"proxy": {"forward_headers": ["X-LB-User"]}}, "proxy.forward_headers[0]: 'X-LB-User' would pass lb's own x-lb-*"),
    ({"proxy": {"forward_headers": ["traceparent", "x-*"]}}, "proxy.forward_headers[1]: 'x-*' would pass lb's own"),
    ({"proxy": {"forward_headers": ["Connection"]}}, "proxy.forward_headers[0]: 'Connection' is a hop-by-hop"),
    ({"proxy": {"forward_headers": ["*"]}}, "proxy.forward_headers[0]: '*' is not a header name; write a name"),
    ({"proxy": {"forward_headers": ["trace parent"]}}, "is not a header name"),
    ({"pushing": {"mod": "blind"}}, "pushing.mod: unknown key; did you mean `mode`?"),
    ({"pushing": {"max_outstanding": 1.5}}, "pushing.max_outstanding: expected an integer"),
    ({"pushing": {"mode": "eager"}}, "pushing.mode: 'eager' is not allowed; use one of: sp-pending"),
    ({"queue": {"orde": "fcfs"}}, "queue.orde: unknown key; did you mean `order`?"),
    ({"queue": {"max_len": "10"}}, "queue.max_len: expected an integer"),
    ({"queue": {"order": "lifo"}}, "queue.order: unknown queue order 'lifo'; choose one of dpa, edf, fcfs"),
    ({"routing": {"polcy": "x"}}, "routing.polcy: unknown key; did you mean `policy`?"),
    ({"routing": {"seed": "x"}}, "routing.seed: expected an integer"),
    ({"routing": {"policy": "fastest"}}, "unknown policy 'fastest'; choose one of cache-aware"),
    ({"routing": {"options": 3}}, "routing.options: expected a table"),
    ({"affinity": {"windw": 3}}, "affinity.windw: unknown key"),
    ({"affinity": {"hold_s": "long"}}, "affinity.hold_s"),
    ({"breaker": {"failure": 3}}, "breaker.failure: unknown key"),
    ({"breaker": {"failures": "x"}}, "breaker.failures: expected an integer"),
    ({"identity": {"api_key": {}}}, "identity.api_key: unknown key; did you mean `api_keys`?"),
    ({"identity": {"api_keys": 3}}, "identity.api_keys: expected a table, got 3"),
    ({"identity": {"require_user": "yes"}}, "identity.require_user: expected true or false"),
    ({"identity": {"default_tier": "iw-f"}}, "identity.default_tier: unknown key"),
    ({"fairness": {"user_rmp": 1}}, "fairness.user_rmp: unknown key; did you mean `user_rpm`?"),
    ({"fairness": {"user_rpm": "x"}}, "fairness.user_rpm: expected an integer"),
    ({"fairness": {"throttle": "maybe"}}, "fairness.throttle: 'maybe' is not one of none, oit, rpm"),
    ({"fairness": {"wsc": {"interaction_credit": -1}}}, "fairness.wsc.interaction_credit: must be a number ≥ 0, got -1"),
    ({"tiers": {"default_teir": "iw-f"}}, "tiers.default_teir: unknown key; did you mean `default_tier`?"),
    ({"tiers": {"tau_n_s": "x"}}, "tiers.tau_n_s: expected a number"),
    ({"tiers": {"default_tier": "gold"}}, "tiers.default_tier: unknown tier 'gold' (iw-f, iw-n, niw)"),
    ({"admission": {"enable": True}}, "admission.enable: unknown key; did you mean `enabled`?"),
    ({"admission": {"enabled": "yes"}}, "admission.enabled: expected true or false"),
    ({"deferred": {"release_one_bellow": 0.5}}, "deferred.release_one_bellow: unknown key; did you mean `release_one_below`?"),
    ({"deferred": {"promote_after_s": "x"}}, "deferred.promote_after_s: expected a number"),
    ({"state": {"backnd": "redis"}}, "state.backnd: unknown key; did you mean `backend`?"),
    ({"state": {"backend": 3}}, "state.backend: expected a string"),
    ({"state": {"backend": "etcd"}}, "state.backend: 'etcd' is not allowed; use one of: memory, redis"),
    ({"state": {"backend": "redis", "url": "localhost:6379"}}, "state.url: 'localhost:6379' is not a Redis URL; write e.g."),
    ({"state": {"url": "redis://h:6379"}}, "state.url/prefix: only for backend = \"redis\""),
    ({"coalesce": {"enable": True}}, "coalesce: unknown keys ['enable']"),
    ({"coalesce": {"enabled": "yes"}}, "coalesce.enabled: must be true or false"),
    ({"peering": {"regoin": "eu"}}, "peering.regoin: unknown key; did you mean `region`?"),
    ({"peering": {"tau": "x"}}, "peering.tau: expected an integer"),
    ({"peering": {"policy": "random"}}, "peering.policy: 'random' is not allowed; use one of: prefix-trie"),
    ({"budgets": {"tokens_per_minute": -5}}, "budgets.tokens_per_minute: must be >= 0"),
    ({"budgets": {"tokens_per_mnute": 5}}, "budgets.tokens_per_mnute: unknown key; did you mean `tokens_per_minute`?"),
    ({"peers": [{"region": "eu"}]}, "peers[0].url: required, a non-empty string"),
    ({"peers": [{"region": "eu", "url": "eu.example"}]}, "peers[0].url: 'eu.example' is not an http(s) URL"),
    ({"peers": [{"region": "eu", "url": "http://e:1", "adopt": "yes"}]}, "peers[0].adopt: expected true or false"),
    ({"peers": [{"regon": "eu", "url": "http://e:1"}]}, "peers[0].regon: unknown key; known keys: region, url"),
    ({"scaling": {"intervl_s": 1}}, "scaling.intervl_s: unknown key; did you mean `interval_s`?"),
    ({"scaling": {"interval_s": "x"}}, "scaling.interval_s: expected a number"),
    ({"scaling": {"strategy": "magic"}}, "unknown scaling strategy 'magic'; choose one of"),
    ({"scaling": {"plan_source": "x"}}, "scaling.plan_source: 'x' is not allowed; use one of: auto, preserve, ilp"),
    ({"scaling": {"plan_file": 3}}, "scaling.plan_file: expected a string"),
    ({"scaling": {"actuators": [{"type": "webhook", "url": "ftp://x", "secret": "s"}]}},
     "scaling.actuators[0]: url: 'ftp://x' is not an http(s) URL; write e.g."),
    ({"scaling": {"actuators": [{"type": "teleport"}]}}, "scaling.actuators[0]"),
    ({"planner": {"horizn": 6}}, "planner.horizn: unknown key; did you mean `horizon`?"),
    ({"planner": {"horizon": "x"}}, "planner.horizon: expected an integer"),
    ({"replicas": [{"url": "http://a:1", "engine": "sglng"}]}, "replicas[0].engine: 'sglng' is not allowed"),
    ({"replicas": [{"url": "a:1"}]}, "replicas[0].url: 'a:1' is not an http(s) URL; write e.g."),
]


@pytest.mark.parametrize("doc,needle", BAD, ids=[f"{next(iter(d))}-{i}" for i, (d, _) in enumerate(BAD)])
def test_bad_value_names_key_and_fix(doc, needle):
    with pytest.raises(ConfigError) as e:
        from_dict(doc)
    assert needle in str(e.value)


def test_every_section_has_a_bad_case():
    sections = {f.name for f in fields(Config)} - {"source"}
    assert sections <= {next(iter(d)) for d, _ in BAD}


def test_effective_config_prints_every_section_and_reads_back(tmp_path):
    """Every example config: all sections in the output, secrets masked, and the printed TOML
    loads back into the same config (a fixed point after one round)."""
    sections = [f.name for f in fields(Config) if f.name not in ("source", "replicas", "peers", "discovery")]
    for path in ("single-region.toml", "fairness.toml", "tiers.toml", "scaling.toml", "three-regions.toml"):
        out = subprocess.run(lb("check-config", str(REPO / "config" / path)), capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = tomllib.loads(out.stdout)
        assert set(sections) <= set(doc), (path, set(sections) - set(doc))
        again = to_toml(from_dict(doc))
        assert to_toml(from_dict(tomllib.loads(again))) == again, path
    fair = subprocess.run(lb("check-config", str(REPO / "config" / "fairness.toml")), capture_output=True,
                          text=True, cwd=REPO, timeout=60).stdout
    assert "sk-team-a" not in fair and '"<key 1>" = "team-a"' in fair
    peered = tmp_path / "p.toml"
    peered.write_text('[peering]\nregion = "us"\nsecret = "hush"\n[scaling]\nstrategy = "lt-i"\n'
                      '[[peers]]\nregion = "eu"\nurl = "http://eu:8080"\nallowed_residency = ["eu"]\n')
    text = to_toml(load(peered))
    assert "hush" not in text and 'secret = "<set>"' in text
    assert '[[peers]]\nregion = "eu"' in text and 'strategy = "lt-i"' in text


def test_check_config_exit_status_and_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[scaling]\nstrategy = "lt-i"\nplan_sorce = "ilp"\n')
    res = subprocess.run(lb("check-config", str(bad)), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 2 and "scaling.plan_sorce: unknown key; did you mean `plan_source`?" in res.stderr
