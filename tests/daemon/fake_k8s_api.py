"""A stand-in Kubernetes API server on loopback for wire-format tests.

    python tests/daemon/fake_k8s_api.py PORT TOKEN

Every API route needs `Authorization: Bearer TOKEN` (else 401, as the API server answers).

- PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale answers the Scale object
  (the scaling actuator's test).
- EndpointSlices (discovery.k8s.io/v1) as the API server serves them: GET
  /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=... lists them with
  the list's resourceVersion; with `watch=true&resourceVersion=N` it streams, one JSON object
  per line, every ADDED/MODIFIED/DELETED event after N, then new ones as they happen,
  BOOKMARK events (allowWatchBookmarks=true) and ends after timeoutSeconds. A watch from a
  resourceVersion older than the compacted history gets the ERROR event with a 410 Status
  ("too old resource version"), as etcd compaction makes a real server answer.

Control routes for the test (no token): PUT/DELETE /_control/slices/{ns}/{name} (body: the
slice) record an event; POST /_control/lose {"put": [...], "delete": [[ns, name]]} cuts every
open watch, applies the changes *without* events and compacts the history, so a client can
only learn of them by relisting after its 410; GET /_control/stats counts lists, watches and
410s; GET /_requests returns what the scale route received; GET /healthz answers ok.
"""
from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web


class Slices:
    def __init__(self) -> None:
        self.rv = 100
        self.compacted = 0  # a watch from below this resourceVersion gets 410
        self.objects: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, dict]] = []
        self.watchers: set[asyncio.Queue] = set()
        self.stats = {"lists": 0, "watches": 0, "gone": 0}

    def _stamp(self, obj: dict) -> dict:
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj.setdefault("apiVersion", "discovery.k8s.io/v1")
        obj.setdefault("kind", "EndpointSlice")
        obj.setdefault("addressType", "IPv4")
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def record(self, kind: str, obj: dict) -> None:
        self.history.append((self.rv, kind, obj))
        for q in self.watchers:
            q.put_nowait((kind, obj))

    def put(self, obj: dict, quiet: bool = False) -> None:
        key = (obj["metadata"].get("namespace", "default"), obj["metadata"]["name"])
        obj["metadata"]["namespace"] = key[0]
        kind = "MODIFIED" if key in self.objects else "ADDED"
        self.objects[key] = obj = self._stamp(obj)
        if not quiet:
            self.record(kind, obj)

    def delete(self, ns: str, name: str, quiet: bool = False) -> bool:
        obj = self.objects.pop((ns, name), None)
        if obj is None:
            return False
        obj = self._stamp(obj)
        if not quiet:
            self.record("DELETED", obj)
        return True

    def lose(self, put: list[dict], delete: list[list[str]]) -> None:
        for q in self.watchers:
            q.put_nowait(None)  # cut the stream
        for obj in put:
            self.put(obj, quiet=True)
        for ns, name in delete:
            self.delete(ns, name, quiet=True)
        self.compacted = self.rv
        self.history.clear()


def flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def matches(selector: str, labels: dict) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k, !k joined by commas."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def main() -> None:
    port, token = int(sys.argv[1]), sys.argv[2]
    seen: list[dict] = []
    slices = Slices()

    def unauthorized(request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "Unauthorized", "code": 401}, status=401)
        return None

    async def scale(request: web.Request) -> web.Response:
        body = await request.text()
        seen.append({"method": request.method, "path": request.path, "body": body,
                     "content_type": request.headers.get("Content-Type"),
                     "authorization": request.headers.get("Authorization")})
        if (denied := unauthorized(request)) is not None:
            return denied
        replicas = json.loads(body)["spec"]["replicas"]
        ns, name = request.match_info["ns"], request.match_info["name"]
        return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                  "metadata": {"name": name, "namespace": ns},
                                  "spec": {"replicas": replicas}})

    async def endpointslices(request: web.Request) -> web.StreamResponse:
        if (denied := unauthorized(request)) is not None:
            return denied
        ns, q = request.match_info["ns"], request.query
        selector = q.get("labelSelector", "")

        def wanted(obj: dict) -> bool:
            return obj["metadata"]["namespace"] == ns and matches(selector, obj["metadata"].get("labels") or {})

        if not flag(q.get("watch")):
            slices.stats["lists"] += 1
            return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                      "metadata": {"resourceVersion": str(slices.rv)},
                                      "items": [o for o in slices.objects.values() if wanted(o)]})
        slices.stats["watches"] += 1
        since = int(q.get("resourceVersion") or slices.rv)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(kind: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since < slices.compacted:
            slices.stats["gone"] += 1
            await send("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                 "message": f"too old resource version: {since} ({slices.compacted})",
                                 "reason": "Expired", "code": 410})
            return resp
        queue: asyncio.Queue = asyncio.Queue()
        slices.watchers.add(queue)
        try:
            for rv, kind, obj in slices.history:
                if rv > since and wanted(obj):
                    await send(kind, obj)
            loop = asyncio.get_running_loop()
            end = loop.time() + float(q.get("timeoutSeconds") or 1800)
            bookmarks = flag(q.get("allowWatchBookmarks"))
            while (left := end - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), min(left, 0.5))
                except TimeoutError:
                    if bookmarks:
                        await send("BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                "metadata": {"resourceVersion": str(slices.rv)}})
                    continue
                if item is None:  # /_control/lose: the connection breaks mid-stream
                    request.transport.close()
                    return resp
                if wanted(item[1]):
                    await send(*item)
        finally:
            slices.watchers.discard(queue)
        return resp

    async def control_put(request: web.Request) -> web.Response:
        obj = await request.json()
        obj.setdefault("metadata", {}).update(namespace=request.match_info["ns"], name=request.match_info["name"])
        slices.put(obj)
        return web.json_response({"resourceVersion": slices.rv})

    async def control_delete(request: web.Request) -> web.Response:
        found = slices.delete(request.match_info["ns"], request.match_info["name"])
        return web.json_response({"resourceVersion": slices.rv}, status=200 if found else 404)

    async def control_lose(request: web.Request) -> web.Response:
        doc = await request.json()
        slices.lose(doc.get("put", []), doc.get("delete", []))
        return web.json_response({"resourceVersion": slices.rv})

    app = web.Application()
    app.router.add_route("PATCH", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", scale)
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", endpointslices)
    app.router.add_put("/_control/slices/{ns}/{name}", control_put)
    app.router.add_delete("/_control/slices/{ns}/{name}", control_delete)
    app.router.add_post("/_control/lose", control_lose)
    app.router.add_get("/_control/stats", lambda r: web.json_response(slices.stats))
    app.router.add_get("/_requests", lambda r: web.json_response(seen))
    app.router.add_get("/healthz", lambda r: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
