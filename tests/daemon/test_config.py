"""Config: TOML into frozen dataclasses; bad keys fail naming the path and the fix."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lb.daemon.config import ConfigError, from_dict, load, with_overrides
from tests.procs import REPO, lb


def test_example_config_loads():
    cfg = load(REPO / "config" / "single-region.toml")
    assert cfg.pushing.mode == "sp-pending" and cfg.probes.interval_s == 0.1
    assert len(cfg.replicas) >= 2 and all(r.engine == "sglang" for r in cfg.replicas)


@pytest.mark.parametrize("doc,needle", [
    ({"replicas": [{"url": "http://a:1", "engine": "sglng"}]}, "replicas[0].engine: 'sglng' is not allowed; use one of: auto, sglang"),
    ({"replicas": [{"engine": "vllm"}]}, "replicas[0]: missing required key `url`"),
    ({"replicas": [{"url": "a:1"}]}, "replicas[0].url"),
    ({"replicas": [{"url": "http://a:1/v1"}]}, "has a path"),
    ({"replicas": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "duplicate replica"),
    ({"probes": {"interval": 0.1}}, "probes.interval: unknown key; did you mean `interval_s`?"),
    ({"probes": {"interval_s": "fast"}}, "probes.interval_s: expected a number"),
    ({"probes": {"interval_s": 0}}, "probes.interval_s: must be > 0"),
    ({"probes": {"max_probe_share": 1.5}}, "probes.max_probe_share: must be in (0, 1]"),
    ({"probes": {"idle_intervals": 0}}, "probes.idle_intervals: must be a whole number >= 1"),
    ({"probes": {"interval_s": float("nan")}}, "probes.interval_s: expected a number, got nan"),
    ({"pushing": {"lease_s": -1}}, "pushing.lease_s: must be a finite number of seconds >= 0"),
    ({"pushing": {"lease_s": float("inf")}}, "pushing.lease_s: must be a finite number of seconds >= 0"),
    ({"pushing": {"lease_s": True}}, "pushing.lease_s: expected a number"),
    ({"probes": {"idle_intervals": 2.5}}, "probes.idle_intervals"),
    ({"pushing": {"mode": "eager"}}, "pushing.mode: 'eager' is not allowed"),
    ({"servr": {}}, "servr: unknown section; did you mean `server`?"),
])
def test_bad_config_names_key_and_fix(doc, needle):
    with pytest.raises(ConfigError) as e:
        from_dict(doc)
    assert needle in str(e.value)


def test_flags_override_file():
    cfg = from_dict({"server": {"port": 1}, "routing": {"policy": "prefix-trie"},
                     "replicas": [{"url": "http://a:1", "engine": "vllm", "models": ["m"]}]})
    over = with_overrides(cfg, port=2, policy="least-load", pushing="blind")
    assert (over.server.port, over.routing.policy, over.pushing.mode) == (2, "least-load", "blind")
    assert over.replicas == cfg.replicas  # untouched without --replica
    swapped = with_overrides(cfg, replicas=["http://b:2/"], engine="sglang")
    assert [(r.url, r.engine) for r in swapped.replicas] == [("http://b:2", "sglang")]


def test_check_config_cli(tmp_path: Path):
    good = subprocess.run(lb("check-config", str(REPO / "config" / "single-region.toml"), "--pushing", "blind"),
                          capture_output=True, text=True, cwd=REPO)
    assert good.returncode == 0, good.stderr
    assert 'mode = "blind"' in good.stdout and "[[replicas]]" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[routing]\npolicy = "fastest"\n')
    res = subprocess.run(lb("check-config", str(bad)), capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "routing.policy" in res.stderr and "prefix-trie" in res.stderr
