"""`lb-bench scenario chaos`, short: streaming load through a real `lb` over emulators and a
replica rotating through every broken shape loses no request (issue 13)."""
from __future__ import annotations

from bench.scenarios import chaos


def test_a_short_chaos_run_loses_nothing(tmp_path):
    summary = chaos.run(tmp_path, quick=True, duration=3.0)
    f = summary["chaos"]
    print("\n" + "\n".join(summary["notes"]))
    assert f["lb_alive"] and f["sent"] > 20 and f["shape_changes"] >= 4, f
    assert f["lost"] == 0, f["lost_examples"]
    assert f["ok"] + f["clear_error"] == f["sent"] and f["ok"] > 0
    assert f["lb_end"]["open_fds"] - f["lb_start"]["open_fds"] < 50
    assert f["lb_end"]["rss_mb"] - f["lb_start"]["rss_mb"] < 60


def test_classify_tells_lost_from_clear():
    assert chaos.classify(200, b'data: {"id":1}\n\ndata: [DONE]\n\n', True) == "ok"
    assert chaos.classify(200, b'data: {"id":1}\n\ndata: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n',
                          True) == "clear_error"
    assert chaos.classify(200, b'data: {"id":1}\n\n', True) == "lost"  # cut without [DONE]
    assert chaos.classify(502, b'{"error": {"message": "m", "type": "server_error"}}', False) == "clear_error"
    assert chaos.classify(500, b"500 Server got itself in trouble", False) == "lost"
    assert chaos.classify(999, b"{}", False) == "lost"
