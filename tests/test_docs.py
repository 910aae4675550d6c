"""The docs cannot rot: README stays a front door, links and named files exist, the config
reference is what the schema generates, and the safe, fast commands the docs show run."""
from __future__ import annotations

import re
import shlex
import subprocess
import tomllib

import pytest

from tests.procs import PYTHON, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/data/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a repository path in backticks, e.g. `config/scaling.toml` or `tests/daemon/test_faults.py`
REPO_PATH = re.compile(r"`((?:lb|bench|config|scripts|tests|docs)/[\w./-]+)`")
# commands that are safe and fast to run wherever the docs show them (module form: no install needed)
SAFE = {"lb check-config": ["-m", "lb.daemon.cli", "check-config"], "lb --version": ["-m", "lb.daemon.cli", "--version"],
        "lb-bench --version": ["-m", "bench.cli", "--version"], "lb-bench scenario --list": ["-m", "bench.cli", "scenario", "--list"]}


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\]\((?:https?:|\.\./|/)", text), "README links only inside the repository"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_and_named_files_exist(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() or REPO.resolve() not in (path, *path.parents):
            missing.append(target)
    for name in REPO_PATH.findall(text):
        if not (REPO / name.rstrip(".")).exists():
            missing.append(name)
    assert not missing, f"{page.name}: {missing}"


def test_config_reference_is_generated_from_the_schema():
    done = subprocess.run([PYTHON, "-m", "lb.daemon.config_doc"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert (REPO / "docs/config.md").read_text() == done.stdout, \
        "docs/config.md is stale: run `python -m lb.daemon.config_doc > docs/config.md`"


def test_readme_minimal_config_loads(tmp_path):
    (toml,) = blocks((REPO / "README.md").read_text(), "toml")
    path = tmp_path / "minimal.toml"
    path.write_text(toml)
    done = subprocess.run([PYTHON, "-m", "lb.daemon.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    effective = tomllib.loads(done.stdout)
    assert effective["pushing"]["mode"] == "sp-pending"
    assert [r["engine"] for r in effective["replicas"]] == ["sglang", "vllm"]


def shown_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in blocks(page.read_text(), "bash"):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                for prefix, argv in SAFE.items():
                    if line == prefix or line.startswith(prefix + " "):
                        found.append((f"{page.name}: {line}", argv + shlex.split(line[len(prefix):])))
    return found


def test_safe_commands_the_docs_show_run():
    commands = shown_commands()
    shown = {label.split(": ", 1)[1] for label, _ in commands}
    assert {"lb check-config config/single-region.toml", "lb --version"} <= shown, shown
    failed = []
    for label, argv in commands:
        done = subprocess.run([PYTHON, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
        if done.returncode != 0:
            failed.append(f"{label}: rc {done.returncode}: {done.stderr.strip()[-300:]}")
    assert not failed, "\n".join(failed)


# every example config but the testbed's (`lb-bench cluster --config config/cluster-example.toml`)
LB_CONFIGS = sorted(p for p in (REPO / "config").glob("*.toml") if p.name != "cluster-example.toml")


@pytest.mark.parametrize("path", LB_CONFIGS, ids=lambda p: p.name)
def test_example_configs_load(path):
    done = subprocess.run([PYTHON, "-m", "lb.daemon.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
