"""The route table's pure parts: one declaration per path, the multipart `model` field found
only from whole parts, FANOUT answers combined, and a request without a model served by any replica."""
from __future__ import annotations

from lb.core.routes import BY_NAME, DIRECT, FANOUT, ROUTES, combine, direct_target, multipart_field
from lb.core.types import ReplicaView


def test_every_path_is_declared_once():
    paths = [(m, p) for r in ROUTES for p in r.paths for m in r.methods]
    assert len(paths) == len(set(paths))
    assert BY_NAME["tokenize"].dispatch == DIRECT and BY_NAME["flush_cache"].dispatch == FANOUT
    assert not BY_NAME["generate"].accepts(ReplicaView(id="v", url="", engine="vllm"))
    assert BY_NAME["embeddings"].accepts(ReplicaView(id="p", url="", engine="peer"))


def test_a_request_without_a_model_is_served_by_any_replica():
    v = ReplicaView(id="a", url="", models=frozenset({"m"}))
    assert v.serves("") and v.serves("m") and not v.serves("x")


def form(*parts: tuple[str, bytes]) -> bytes:
    return b"".join(b'--B\r\nContent-Disposition: form-data; name="' + n.encode() + b'"\r\n\r\n' + v + b"\r\n"
                    for n, v in parts) + b"--B--\r\n"


def test_multipart_model_field():
    body = form(("model", b"whisper-1"), ("file", b"\0" * 100))
    assert multipart_field(body, b"B", b"model") == (True, "whisper-1")
    cut = body.index(b"whisper") + 3  # the value is not whole until the next delimiter
    assert multipart_field(body[:cut], b"B", b"model") == (False, None)
    assert multipart_field(form(("file", b"x")), b"B", b"model") == (True, None)  # ended without it
    late = form(("file", b"\r\n--not-it\r\n"), ("model", b"m2"))
    assert multipart_field(late, b"B", b"model") == (True, "m2")
    assert multipart_field(late[:20], b"B", b"model") == (False, None)


class T:
    def __init__(self, id: str, outstanding: int = 0, healthy: bool = True, engine: str = "sglang",
                 models: frozenset = frozenset({"m"}), breaker=None):
        self.view = ReplicaView(id=id, url="", outstanding=outstanding, healthy=healthy, engine=engine, models=models)
        self.breaker = breaker


class Open:
    def allows(self, now: float) -> bool:
        return False


def test_direct_target_least_busy_untried_eligible():
    any_ = BY_NAME["tokenize"].accepts
    ts = [T("b", 1), T("c"), T("a")]
    assert direct_target(ts, "m", any_, (), 0.0).view.id == "a"  # ties by id
    assert direct_target(ts, "m", any_, {"a"}, 0.0).view.id == "c"  # one not tried yet
    assert direct_target(ts, "m", any_, {"a", "b", "c"}, 0.0).view.id == "a"  # all tried: any again
    assert direct_target([T("a", healthy=False), T("b", breaker=Open()), T("c", models=frozenset({"x"}))],
                         "m", any_, (), 0.0) is None
    assert direct_target([T("v", engine="vllm")], "", BY_NAME["generate"].accepts, (), 0.0) is None


def test_combine_keeps_the_engine_shape_and_flush_needs_every_replica():
    status, doc = combine("model_info", [("r1", 200, {"model_path": "p"}), ("r2", 0, "ConnectionError")])
    assert status == 200 and doc["model_path"] == "p" and [r["id"] for r in doc["lb_replicas"]] == ["r1", "r2"]
    down = combine("server_info", [("r1", 0, "down")])
    assert down.code == "upstream_unavailable" and down.replica_status is None and down.replicas[0]["id"] == "r1"
    assert combine("flush_cache", [("r1", 200, "ok"), ("r2", 200, "ok")])[1]["flushed"] == 2
    failed = combine("flush_cache", [("r1", 200, "ok"), ("r2", 400, "Cache not flushed")])
    assert failed.replica_status == 400 and failed.code == "flush_failed" and "r2 (400)" in failed.message


def test_a_stored_response_is_its_owners_answer():
    assert combine("response", [("r1", 404, {}), ("r2", 200, {"id": "resp_1"})]) == (200, {"id": "resp_1"})
    assert combine("response_cancel", [("r1", 404, {}), ("r2", 400, {"error": "no"})]) == (400, {"error": "no"})
    missing = combine("response", [("r1", 404, {}), ("r2", 0, "down")])
    assert missing.code == "response_not_found" and missing.param == "response_id"
