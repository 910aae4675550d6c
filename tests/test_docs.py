"""The docs cannot rot: README stays a front door, links and named files exist, the config
reference is what the schema generates, and the safe, fast commands the docs show run."""
from __future__ import annotations

import re
import shlex
import tomllib

import pytest

from bench.cli import main as lb_bench_main
from lb.daemon.cli import main as lb_main
from lb.daemon.config_doc import render
from tests.procs import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/data/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a repository path in backticks, e.g. `config/scaling.toml` or `tests/daemon/test_faults.py`
REPO_PATH = re.compile(r"`((?:lb|bench|config|scripts|tests|docs)/[\w./-]+)`")
# commands that are safe and fast to run wherever the docs show them: (CLI entry point, its argv)
SAFE = {"lb check-config": (lb_main, ["check-config"]), "lb --version": (lb_main, ["--version"]),
        "lb-bench --version": (lb_bench_main, ["--version"]),
        "lb-bench scenario --list": (lb_bench_main, ["scenario", "--list"])}


def run_cli(main, argv: list[str]) -> int:
    """A CLI's exit status, run in this process (argparse's --version exits via SystemExit)."""
    try:
        return int(main(argv) or 0)
    except SystemExit as e:
        return int(e.code or 0)


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


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
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve()
        if not path.exists() or REPO.resolve() not in (path, *path.parents):
            missing.append(target)
        elif anchor and anchor not in anchors(path):
            missing.append(target)
    for name in REPO_PATH.findall(text):
        if not (REPO / name.rstrip(".")).exists():
            missing.append(name)
    assert not missing, f"{page.name}: {missing}"


def test_config_reference_is_generated_from_the_schema():
    assert (REPO / "docs/config.md").read_text() == render(), \
        "docs/config.md is stale: run `python -m lb.daemon.config_doc > docs/config.md`"


def test_readme_minimal_config_loads(tmp_path, capsys):
    (toml,) = blocks((REPO / "README.md").read_text(), "toml")
    path = tmp_path / "minimal.toml"
    path.write_text(toml)
    assert lb_main(["check-config", str(path)]) == 0, capsys.readouterr().err
    effective = tomllib.loads(capsys.readouterr().out)
    assert effective["pushing"]["mode"] == "sp-pending"
    assert [r["engine"] for r in effective["replicas"]] == ["auto", "vllm"]  # the first left out: detected


def shown_commands() -> list[tuple[str, object, list[str]]]:
    found = []
    for page in PAGES:
        for block in blocks(page.read_text(), "bash"):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                for prefix, (main, argv) in SAFE.items():
                    if line == prefix or line.startswith(prefix + " "):
                        found.append((f"{page.name}: {line}", main, argv + shlex.split(line[len(prefix):])))
    return found


def test_safe_commands_the_docs_show_run(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the repository root
    commands = shown_commands()
    shown = {label.split(": ", 1)[1] for label, _, _ in commands}
    assert {"lb check-config config/single-region.toml", "lb --version"} <= shown, shown
    failed = []
    for label, main, argv in commands:
        if (rc := run_cli(main, argv)) != 0:
            failed.append(f"{label}: rc {rc}: {capsys.readouterr().err.strip()[-300:]}")
    assert not failed, "\n".join(failed)


# every example config but the testbed's (`lb-bench cluster --config config/cluster-example.toml`)
LB_CONFIGS = sorted(p for p in (REPO / "config").glob("*.toml") if p.name != "cluster-example.toml")


@pytest.mark.parametrize("path", LB_CONFIGS, ids=lambda p: p.name)
def test_example_configs_load(path, capsys):
    assert lb_main(["check-config", str(path)]) == 0, capsys.readouterr().err
