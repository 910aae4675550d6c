"""The repository stands alone: no path outside it, a licence, one version, a CI entry point
that passes its arguments to pytest."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import tomllib

from tests.procs import PYTHON, REPO

SKIP_DIRS = {".git", ".venv", "out", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".cache"}
# Spelled in pieces so this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "LB_" + "SHARED_DATA", "shared/" + "data",
                               "DESIGN" + r"\.md", "ENGINES" + r"\.md", "/work" + "/"]))


def repo_text_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name in SKIP_DIRS:  # a worktree's .git is a file naming its main repository
                continue
            path = os.path.join(root, name)
            if name.endswith((".png", ".whl", ".pyc", ".gguf", ".csv", ".jsonl")):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, REPO), f.read()
            except UnicodeDecodeError:
                continue


def test_nothing_refers_to_files_outside_the_repository():
    hits = [f"{path}:{n}: {line.strip()}" for path, text in repo_text_files()
            for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def test_licence_and_version_come_from_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    for module, prog in (("lb.daemon.cli", "lb"), ("bench.cli", "lb-bench")):
        done = subprocess.run([PYTHON, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == f"{prog} {project['version']}", done


def test_ci_run_passes_its_arguments_to_pytest(tmp_path):
    # .ci/run and scripts/test.sh as they are; the installer stubbed (it would apt-get and pip
    # install), and a python that prints the arguments it was given (and has pytest-xdist when
    # XDIST says so: `python -c "import xdist"` succeeds).
    for rel in (".ci/run", "scripts/test.sh"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    (tmp_path / "scripts/install-deps.sh").write_text("true\n")
    python = tmp_path / ".venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nif [ "$1" = -c ]; then [ "$XDIST" = 1 ]; exit $?; fi\necho "python $*"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)

    def ci_run(**env) -> str:
        done = subprocess.run(["bash", str(tmp_path / ".ci/run"), "tests/core", "-x"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "LB_TEST_WORKERS": "", **env})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert ci_run(XDIST="1") == "python -m pytest -q -p no:cacheprovider -n 2 tests/core -x"
    assert ci_run(XDIST="1", LB_TEST_WORKERS="0") == "python -m pytest -q -p no:cacheprovider -n 0 tests/core -x"
    assert ci_run(XDIST="0") == "python -m pytest -q -p no:cacheprovider tests/core -x"
