"""Four real vLLM replicas on one GPU machine, `lb` and its alternatives in front, the same ToT load.

    python -m bench.real_vllm.model /tmp/model          # config + tokenizer, no hub access needed
    python -m bench.real_vllm.fleet vllm /tmp/model OUT [rounds] [duration_s]   # CLIENTS=30 by default
    python -m bench.real_vllm.fleet emu  -          OUT 1 5   # the same harness over emulators

`vllm` mode starts four `vllm.entrypoints.openai.api_server` processes on 127.0.0.1:8001-8004
(random weights via `--load-format dummy`, 8 GiB of KV each, so four share one H100/H200), then
runs `lb` (default policy, SP-P), `lb` with blind pushing, `lb`'s consistent-hash policy (the
stand-in for nginx `hash $session consistent`), SGLang Router `cache_aware` (SkyWalker's
blind-pushing baseline) and clients round-robining over the replicas directly, `rounds` times
interleaved. The environment picks the engines' working point and the systems:

    CLIENTS=30 KV_GIB=1 MAX_MODEL_LEN=4096 MAX_NUM_SEQS=16 SYSTEMS='lb,lb blind' python -m ...

`KV_GIB` is each replica's KV cache (GiB; the emulators get as many tokens at this shape's
128 KiB a token), `MAX_NUM_SEQS` vLLM's batch cap (the emulators' `--max-running`); a small KV
or cap is what makes engines queue, the only place selective pushing can differ from blind.
`LB_BEFORE` (another checkout of lb) adds the system "lb before", interleaved with this one on
the same engines: an A/B of a change. `WORKLOAD` and `WORKLOAD_PARAMS` pick the clients'
workload (`lb-bench run --workload/--param`) and `MAX_TOKENS` what its clients declare as
max_tokens (`--max-tokens`: exact, none or N); in `emu` mode `EMU_PROFILE` picks the engine model
and `EMU_SPEED` runs the emulators, an open-loop replay and lb's engine-time constants that many
times faster; `LB_CONFIG` is a config file every lb system starts with.

Every run starts from empty prefix caches (vLLM dev mode's `POST /reset_prefix_cache`), reads
the engines' own counters before and after (prefix-cache hits, preemptions) and samples their running/waiting every 0.25 s. Rows go to OUT/summary.json as
they finish; logs to OUT/logs.tgz. Not part of the test suite's GPU-free CI beyond `emu` mode.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from bench.fleet import free_port, wait_http
from bench.workloads.base import EXACT, check_max_tokens
from lb.core.loadparse import prometheus_values

MODE = MODEL = OUT = LOGS = None
ROUNDS, DURATION = 2, 25.0


def _env(name: str, kind, default):
    """An environment setting, or exit naming it and what it must be."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise SystemExit(f"{name}: must be a positive {kind.__name__}, got {raw!r}")
    return value


CLIENTS = _env("CLIENTS", int, 30)
KV_GIB = _env("KV_GIB", float, 8.0)
MAX_MODEL_LEN = _env("MAX_MODEL_LEN", int, 8192)
MAX_NUM_SEQS = _env("MAX_NUM_SEQS", int, None)  # None: vLLM's own default
EMU_PROFILE = os.environ.get("EMU_PROFILE") or "h100-llama3-8b"  # `emu` mode's engine model (bench/profiles.py)
LB_CONFIG = os.environ.get("LB_CONFIG") or None  # a TOML file every `lb` system starts with (e.g. [probes])
# another checkout of lb (e.g. `git worktree add /tmp/before HEAD~1`): the system "lb before" runs
# lb's default from there, interleaved with this checkout's on the same engines (an A/B of a change)
LB_BEFORE = os.environ.get("LB_BEFORE") or None
WORKLOAD = os.environ.get("WORKLOAD") or "tot"  # any of `lb-bench run --workload`'s
# its parameters, `lb-bench run --param`'s KEY=VALUE, space-separated (e.g. total_rps=4.17)
WORKLOAD_PARAMS = (os.environ.get("WORKLOAD_PARAMS") or "").split()
# what the clients declare as max_tokens (`lb-bench run --max-tokens`): exact, none or N
try:
    MAX_TOKENS = check_max_tokens(os.environ.get("MAX_TOKENS") or EXACT)
except ValueError as exc:
    raise SystemExit(f"MAX_TOKENS: {exc}") from None
# `emu` mode: the emulators run this many times faster than the hardware they model, and so do an
# open-loop replay and every `lb` time constant (bench.scenarios._lb.engine_time_config), as the
# `compare-*` scenarios run them
EMU_SPEED = _env("EMU_SPEED", float, 1.0)
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # Llama-3-8B: layers x KV heads x head dim x (K, V) x bf16
N = 4
PORTS: list[int] = []
URLS: list[str] = []
LB = ""  # lb's base URL
PY = sys.executable
procs = []


def start(name, args, env=None, cwd=None):
    f = open(LOGS / f"{name}.log", "w")
    p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                         start_new_session=True, cwd=cwd)
    procs.append((name, p))
    return p


def cpu_s(pid):
    """CPU seconds (user + system) a process has used so far; None once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def post(url):
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except Exception as e:
        return str(e)


def wait(url, proc, timeout, name):
    t0 = time.time()
    try:
        wait_http(url, timeout, proc)
    except (RuntimeError, TimeoutError) as e:
        print(f"{name}: {e}; log tail:\n" + (LOGS / f"{name}.log").read_text()[-3000:])
        raise SystemExit(1)
    return time.time() - t0


def metric(text, name):
    return prometheus_values(text.encode(), [name]).get(name, 0.0)


def counters():
    c = {"queries": 0.0, "hits": 0.0, "preemptions": 0.0, "prompt": 0.0}
    for u in URLS:
        t = get(u + "/metrics")[1]
        c["queries"] += metric(t, "vllm:prefix_cache_queries_total")
        c["hits"] += metric(t, "vllm:prefix_cache_hits_total")
        c["preemptions"] += metric(t, "vllm:num_preemptions_total")
        c["prompt"] += metric(t, "vllm:prompt_tokens_total")
    return c


class Sampler(threading.Thread):
    """Every 0.25 s: each engine's running and waiting, as it publishes them."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.rows = threading.Event(), []

    def run(self):
        while not self.stop.is_set():
            row = []
            for u in URLS:
                try:
                    t = get(u + "/metrics", 2)[1]
                    row.append((metric(t, "vllm:num_requests_running"), metric(t, "vllm:num_requests_waiting"),
                                metric(t, "vllm:kv_cache_usage_perc")))
                except Exception:
                    row.append((float("nan"),) * 3)
            self.rows.append(row)
            self.stop.wait(0.25)

    def summary(self):
        rows = [r for r in self.rows if all(x == x for sample in r for x in sample)]
        if not rows:
            return {}
        load = [[a + b for a, b, _ in r] for r in rows]
        return {"samples": len(rows), "waiting_max": max(b for r in rows for _, b, _ in r),
                "waiting_mean": sum(b for r in rows for _, b, _ in r) / len(rows),
                "running_mean": sum(a for r in rows for a, _, _ in r) / len(rows),
                "imbalance_mean": sum(max(l) - min(l) for l in load) / len(load),
                "kv_usage_mean": sum(k for r in rows for _, _, k in r) / (len(rows) * N)}


def engines():
    if MODE == "vllm":
        for i, p in enumerate(PORTS):
            start(f"engine{i}", [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
                                 "--served-model-name", "llama-8b-shape", "--port", str(p),
                                 "--load-format", "dummy", "--enforce-eager",
                                 "--kv-cache-memory-bytes", str(int(KV_GIB * 2**30)), "--gpu-memory-utilization", "0.2",
                                 "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details", "--seed", str(i),
                                 *(["--max-num-seqs", str(MAX_NUM_SEQS)] if MAX_NUM_SEQS else [])],
                  env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    else:
        for i, p in enumerate(PORTS):
            # admitting as vLLM's V1 scheduler does: by prompt blocks, no decode reservation
            start(f"engine{i}", [PY, "-m", "bench.cli", "emulate", "--port", str(p), "--profile",
                                 EMU_PROFILE, "--seed", str(i), "--decode-reserve", "0", "--speed", str(EMU_SPEED),
                                 "--kv-tokens", str(int(KV_GIB * 2**30) // KV_BYTES_PER_TOKEN),
                                 *(["--max-running", str(MAX_NUM_SEQS)] if MAX_NUM_SEQS else [])])
    t = [wait(u + "/health", p, 240, n) for u, (n, p) in zip(URLS, procs[:N])]
    print(f"engines ready after {max(t):.0f} s", flush=True)
    (OUT / "engine0-metrics.txt").write_text(get(URLS[0] + "/metrics")[1])


ALL_SYSTEMS = {
    "lb": ("predicted-ttft", "sp-pending"),
    "lb before": ("predicted-ttft", "sp-pending"),
    "lb blind": ("predicted-ttft", "blind"),
    "lb consistent-hash": ("consistent-hash", "blind"),
    "sglang-router cache_aware": ("sglang-router", "cache_aware"),
    "direct-rr": None,
}
SYSTEMS = {n: v for n, v in ALL_SYSTEMS.items() if n != "lb before" or LB_BEFORE}


def start_router(system, rnd):
    """The system's router on LB's port, ready; None for clients going to the replicas directly."""
    if ALL_SYSTEMS[system] is None:
        return None
    name, port = f"lb-{rnd}-{system.replace(' ', '_')}", LB.rsplit(":", 1)[1]
    kind, mode = ALL_SYSTEMS[system]
    if kind == "sglang-router":
        proc = start(name, [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", port,
                            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                            "--worker-urls", *URLS, "--policy", mode])
        wait(LB + "/v1/models", proc, 60, name)
        return proc
    tree = {"PYTHONPATH": LB_BEFORE} if system == "lb before" else None
    proc = start(name, [PY, "-m", "lb.daemon.cli", "serve", "--port", port, "--engine", "vllm", "--policy", kind,
                        "--pushing", mode, "--admin-token", "t", *[a for u in URLS for a in ("--replica", u)],
                        *(["--config", str(pathlib.Path(LB_CONFIG).resolve())] if LB_CONFIG else [])], env=tree, cwd=LB_BEFORE if tree else None)
    wait(LB + "/ready", proc, 30, name)
    time.sleep(1.0)  # a few probes
    if rnd == 0 and system == "lb":
        req = urllib.request.Request(LB + "/admin/replicas", headers={"Authorization": "Bearer t"})
        (OUT / "lb-admin-replicas.json").write_text(urllib.request.urlopen(req, timeout=5).read().decode())
    return proc


def run_one(system, rnd):
    for u in URLS:
        post(u + "/reset_prefix_cache")
    lbp = start_router(system, rnd)
    target = ["--target", LB] if lbp is not None else [a for u in URLS for a in ("--target", u)]
    before = counters()
    cpu_before = cpu_s(lbp.pid) if lbp is not None else None
    s = Sampler(); s.start()
    rep = OUT / f"run-{rnd}-{system.replace(' ', '_')}.json"
    t0 = time.time()
    r = subprocess.run([PY, "-m", "bench.cli", "run", *target, "--workload", WORKLOAD, "--clients", str(CLIENTS),
                        "--duration", str(DURATION), "--seed", "0", "--out", str(rep),
                        *[a for kv in WORKLOAD_PARAMS for a in ("--param", kv)], "--max-tokens", str(MAX_TOKENS),
                        *(["--time-scale", str(EMU_SPEED)] if EMU_SPEED != 1 else [])],
                       capture_output=True, text=True)
    s.stop.set(); s.join()
    after = counters()
    cpu_after = cpu_s(lbp.pid) if lbp is not None else None
    lb_page = b""
    if lbp is not None:
        if ALL_SYSTEMS[system][0] != "sglang-router":
            try:
                lb_page = get(LB + "/metrics")[1].encode()
                (LOGS / f"lb-metrics-{rnd}-{system.replace(' ', '_')}.txt").write_bytes(lb_page)
            except Exception as e:
                print("lb metrics:", e)
        os.killpg(lbp.pid, signal.SIGTERM); lbp.wait(10)
    if r.returncode != 0:
        print(system, "bench failed", r.returncode, r.stderr[-2000:])
        return None
    d = json.loads(rep.read_text()); rep.unlink()
    q = after["queries"] - before["queries"]
    row = {"system": system, "round": rnd, "wall_s": round(time.time() - t0, 1), "requests": d["requests"],
           "ok": d["ok"], "errors": d["errors"], "throughput_rps": d["throughput_rps"],
           "ttft_p50_ms": d["ttft_s"]["p50"] * 1e3, "ttft_p90_ms": d["ttft_s"]["p90"] * 1e3,
           "e2e_p50_s": d["e2e_s"]["p50"], "client_cached_ratio": d["cached_token_ratio"],
           "engine_hit_ratio": (after["hits"] - before["hits"]) / q if q else None,
           "preemptions": after["preemptions"] - before["preemptions"], "max_tokens": d.get("max_tokens"),
           **s.summary()}
    if cpu_before is not None and cpu_after is not None:  # the router's own CPU over the run
        row["router_cpu_share"] = (cpu_after - cpu_before) / row["wall_s"]
    # how long requests waited in lb's own queue (SP-P holds them there instead of in the engines)
    # and what one probe of an engine took (its load endpoint's latency: what spaces early re-probes)
    for key, metric in (("lb_queue_wait_mean_ms", "lb_queue_wait_seconds"), ("lb_probe_mean_ms", "lb_probe_latency_seconds")):
        got = prometheus_values(lb_page, [metric + "_sum", metric + "_count"])
        if got.get(metric + "_count"):
            row[key] = 1e3 * got[metric + "_sum"] / got[metric + "_count"]
    print(json.dumps(row), flush=True)
    return row


def engine_time_toml(out: pathlib.Path) -> str:
    """A config file with lb's engine-time constants divided by EMU_SPEED; its path."""
    from bench.cluster import lb_toml
    from bench.scenarios._lb import engine_time_config
    if LB_CONFIG:
        raise SystemExit("EMU_SPEED with LB_CONFIG: put the scaled constants (bench.scenarios._lb.engine_time_config) "
                         "in LB_CONFIG's file and leave EMU_SPEED at 1")
    path = out / "lb-engine-time.toml"
    path.write_text(lb_toml(engine_time_config(EMU_SPEED), [], []))
    return str(path.resolve())


def main():
    global MODE, MODEL, OUT, ROUNDS, DURATION, LOGS, PORTS, URLS, LB, SYSTEMS, LB_CONFIG
    if os.environ.get("SYSTEMS"):
        names = [n.strip() for n in os.environ["SYSTEMS"].split(",")]
        unknown = [n for n in names if n not in ALL_SYSTEMS]
        if unknown:
            raise SystemExit(f"SYSTEMS: unknown {unknown}; choose from {list(ALL_SYSTEMS)}")
        if "lb before" in names and not LB_BEFORE:
            raise SystemExit("SYSTEMS names 'lb before': set LB_BEFORE to the other checkout's directory")
        SYSTEMS = {n: ALL_SYSTEMS[n] for n in names}
    if LB_BEFORE and not (pathlib.Path(LB_BEFORE) / "lb" / "daemon" / "cli.py").is_file():
        # without it the interpreter would find this checkout's lb and the A/B compare it with itself
        raise SystemExit(f"LB_BEFORE: {LB_BEFORE!r} holds no lb/daemon/cli.py; give a checkout of lb "
                         "(e.g. `git worktree add /tmp/before HEAD~1`)")
    MODE, MODEL, OUT = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    DURATION = float(sys.argv[5]) if len(sys.argv) > 5 else 25
    LOGS = OUT / "logs"
    if EMU_SPEED != 1:
        if MODE != "emu":
            raise SystemExit("EMU_SPEED: only `emu` mode's engines can run faster than their hardware")
        OUT.mkdir(parents=True, exist_ok=True)
        LB_CONFIG = engine_time_toml(OUT)
    # vLLM: the ports the GPU runs used; emulators (tests): any free ones
    PORTS = [8001 + i for i in range(N)] if MODE == "vllm" else [free_port() for _ in range(N)]
    URLS = [f"http://127.0.0.1:{p}" for p in PORTS]
    LB = f"http://127.0.0.1:{8200 if MODE == 'vllm' else free_port()}"
    LOGS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        engines()
        rows = []
        for rnd in range(ROUNDS):
            order = list(SYSTEMS) if rnd % 2 == 0 else list(reversed(SYSTEMS))
            for system in order:
                rows.append(run_one(system, rnd))
                (OUT / "summary.json").write_text(json.dumps(rows, indent=1))
    finally:
        for name, p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except Exception:
                pass
        time.sleep(2)
        subprocess.run(["tar", "czf", str(OUT / "logs.tgz"), "-C", str(OUT), "logs"])
        subprocess.run(["rm", "-rf", str(LOGS)])
        print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
