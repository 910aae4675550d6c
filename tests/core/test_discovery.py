"""lb.core.discovery: what the replica set becomes after a list, a watch event or a lookup."""
from __future__ import annotations

import pytest

from lb.core.discovery import DiscoveryConfig, Endpoint, EndpointSlices, diff, dns_endpoints, slice_endpoints

K8S = DiscoveryConfig(kind="kubernetes", selector="app=sglang", engine="vllm")


def slice_(name: str, *eps: tuple[str, dict], port: int = 8000, port_name: str = "http", labels=None,
           annotations=None, rv: str = "1") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv, "labels": labels or {},
                         "annotations": annotations or {}},
            "ports": [{"name": "metrics", "port": 9090}, {"name": port_name, "port": port}],
            "endpoints": [{"addresses": [addr], "conditions": cond} for addr, cond in eps]}


READY = {"ready": True}


def test_only_ready_and_not_terminating_endpoints_serve():
    s = slice_("a", ("10.0.0.1", READY), ("10.0.0.2", {"ready": False}),
               ("10.0.0.3", {"ready": False, "serving": True, "terminating": True}),
               ("10.0.0.4", {}))  # no conditions: ready, as the API defines
    cfg = DiscoveryConfig(kind="kubernetes", selector="x", port="http")
    assert [e.key for e in slice_endpoints(s, cfg)] == ["10.0.0.1:8000", "10.0.0.4:8000"]


def test_port_by_name_number_or_first_and_ipv6():
    s = slice_("a", ("fd00::1", READY))
    assert slice_endpoints(s, DiscoveryConfig(kind="kubernetes", selector="x", port="http"))[0].url == "http://[fd00::1]:8000"
    assert slice_endpoints(s, DiscoveryConfig(kind="kubernetes", selector="x", port="9090"))[0].key == "[fd00::1]:9090"
    assert slice_endpoints(s, DiscoveryConfig(kind="kubernetes", selector="x"))[0].key == "[fd00::1]:9090"
    assert slice_endpoints(s, DiscoveryConfig(kind="kubernetes", selector="x", port="grpc")) == []


def test_engine_and_models_from_labels_annotations_or_config():
    s = slice_("a", ("10.0.0.1", READY), labels={"lb/engine": "sglang", "lb/model": "small"})
    ep = slice_endpoints(s, DiscoveryConfig(kind="kubernetes", selector="x", port="http"))[0]
    assert (ep.engine, ep.models) == ("sglang", ("small",))
    s = slice_("a", ("10.0.0.1", READY), annotations={"lb/models": "org/big, org/small"})
    ep = slice_endpoints(s, K8S)[0]
    assert (ep.engine, ep.models) == ("vllm", ("org/big", "org/small"))
    ep = slice_endpoints(slice_("a", ("10.0.0.1", READY)), K8S)[0]
    assert ep.models == ()  # none given: the prober reads /v1/models
    fixed = DiscoveryConfig(kind="kubernetes", selector="x", models=("m",))
    assert slice_endpoints(s, fixed)[0].models == ("m",)


def test_events_then_relist_replaces_everything():
    view = EndpointSlices(DiscoveryConfig(kind="kubernetes", selector="x", port="http"))
    view.relist([slice_("a", ("10.0.0.1", READY))], "10")
    view.event("ADDED", slice_("b", ("10.0.0.2", READY), rv="11"))
    view.event("MODIFIED", slice_("a", ("10.0.0.1", {"ready": False, "terminating": True}), rv="12"))
    assert set(view.endpoints()) == {"10.0.0.2:8000"} and view.resource_version == "12"
    view.event("BOOKMARK", {"metadata": {"resourceVersion": "20"}})
    assert view.resource_version == "20" and set(view.endpoints()) == {"10.0.0.2:8000"}
    view.event("DELETED", slice_("b", ("10.0.0.2", READY), rv="21"))
    assert view.endpoints() == {}
    view.event("ADDED", slice_("c", ("10.0.0.3", READY), rv="22"))
    view.relist([slice_("d", ("10.0.0.4", READY))], "40")  # c was deleted while the watch was lost
    assert set(view.endpoints()) == {"10.0.0.4:8000"} and view.resource_version == "40"
    with pytest.raises(ValueError, match="ERROR"):
        view.event("ERROR", {"code": 410})


def test_diff_adds_drains_changes_and_leaves_other_sources_alone():
    a = Endpoint("a:1", "http://a:1", "sglang", ())
    b = Endpoint("b:1", "http://b:1", "sglang", ())
    b2 = Endpoint("b:1", "http://b:1", "vllm", ())
    c = Endpoint("c:1", "http://c:1", "sglang", ())
    add, drain = diff({"a:1": a, "b:1": b}, {"b:1": b2, "c:1": c, "s:1": Endpoint("s:1", "http://s:1", "x", ())},
                      taken={"s:1"})
    assert add == [b2, c] and drain == ["a:1", "b:1"]
    assert diff({"a:1": a}, {"a:1": a}) == ([], [])


def test_dns_records_take_the_srv_port_or_the_configured_one():
    srv = DiscoveryConfig(kind="dns", name="_http._tcp.x")
    assert list(dns_endpoints([("10.0.0.1", 30000), ("10.0.0.1", 30000), ("10.0.0.2", 30001)], srv)) == [
        "10.0.0.1:30000", "10.0.0.2:30001"]
    a = DiscoveryConfig(kind="dns", name="x", record="A", port="8000", engine="sglang", models=("m",))
    assert dns_endpoints([("10.0.0.1", 0)], a) == {"10.0.0.1:8000": Endpoint("10.0.0.1:8000", "http://10.0.0.1:8000",
                                                                             "sglang", ("m",))}


@pytest.mark.parametrize("cfg, error", [
    (DiscoveryConfig(kind="consul"), r"d\.kind: 'consul' is not allowed"),
    (DiscoveryConfig(kind="kubernetes"), r"d\.selector: required"),
    (DiscoveryConfig(kind="dns"), r"d\.name: required"),
    (DiscoveryConfig(kind="dns", name="x", record="A"), r"d\.port: A records carry no port"),
    (DiscoveryConfig(kind="dns", name="x", record="MX"), r"d\.record: 'MX' is not allowed"),
    (DiscoveryConfig(kind="dns", name="x", scheme="grpc"), r"d\.scheme"),
    (DiscoveryConfig(kind="dns", name="x", port="70000"), r"d\.port: 70000 is not a TCP port"),
])
def test_config_errors_name_the_key(cfg, error):
    with pytest.raises(ValueError, match=error):
        cfg.check("d")
