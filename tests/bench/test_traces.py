"""The datasets shipped in bench/data: every loader reads the in-repo copy, and a missing or
corrupt file stops `lb-bench` with one line naming it (no traceback)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import traces
from tests.procs import REPO, lb_bench

DATA = REPO / "bench" / "data"


def test_loaders_read_the_slices_shipped_in_the_repository():
    assert traces.DATA_DIR.resolve() == DATA.resolve()
    assert len(traces.azure_conv()) == 10_108
    assert len(traces.mooncake_conversation()) == 2_728
    clients = traces.servegen_clients()
    assert len(clients) == 43 and {len(w) for w in clients.values()} == {1_008}
    assert len(traces.gsm8k_questions()) == 200
    assert len(traces.mtbench_conversations()) == 80


def test_each_source_has_its_licence_and_is_cited():
    readme = (DATA / "README.md").read_text()
    for source in ("azure", "mooncake", "servegen", "gsm8k", "mtbench"):
        assert (DATA / source / "LICENSE").stat().st_size > 500, source
        assert f"]({source}/LICENSE)" in readme, source


def bench_with_data(data: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LB_BENCH_DATA": str(data)}
    return subprocess.run(lb_bench(*args), capture_output=True, text=True, timeout=60, env=env)


# port 9 (discard) is never contacted: the workload reads its data before any request
TOT_RUN = ("run", "--target", "http://127.0.0.1:9", "--model", "m", "--workload", "tot", "--requests", "1")


@pytest.mark.parametrize("args", [TOT_RUN, ("calibrate", "--profile", "tiny")])
def test_a_missing_dataset_is_one_line_naming_it(tmp_path, args):
    done = bench_with_data(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "is absent" in lines[0] and str(tmp_path) in lines[0]


def test_a_corrupt_dataset_is_one_line_naming_the_file(tmp_path):
    shutil.copytree(DATA / "gsm8k", tmp_path / "gsm8k")
    bad = tmp_path / "gsm8k" / "test_first200.jsonl"
    bad.write_text(bad.read_text()[:5000] + "\n{not json\n")
    done = bench_with_data(tmp_path, *TOT_RUN)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{bad} is corrupt" in lines[0]


def test_a_corrupt_csv_row_is_reported_by_the_loader(tmp_path, monkeypatch):
    (tmp_path / "azure").mkdir()
    (tmp_path / "azure" / "conv_2023_first30min.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\nnot-a-time,x,y\n")
    monkeypatch.setattr(traces, "DATA_DIR", tmp_path)
    traces.azure_conv.cache_clear()
    try:
        with pytest.raises(traces.TraceCorrupt, match="conv_2023_first30min.csv is corrupt"):
            traces.azure_conv()
    finally:
        traces.azure_conv.cache_clear()
