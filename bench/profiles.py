"""Named engine profiles: hardware × model → KV capacity and step-time coefficients.

Step time (seconds) = step_base_s + prefill_token_s·(prefill tokens in the step)
                     + decode_seq_s·(decoding sequences) + context_token_s·(context tokens read).
`step_base_s` is the weight read every forward pass pays (memory-bound decode); the
prefill term is compute-bound; the context term is the KV read of attention.

Each profile states where its numbers come from. "Derived" means arithmetic from public
datasheets and model configs (shown in the comment), not a measurement; `reference` holds
the numbers `lb-bench calibrate` prints next to what the model produces.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


# sglang python/sglang/srt/environ.py (main, 2025): SGLANG_INIT_NEW_TOKEN_RATIO 0.7,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600.
SGLANG_NEW_TOKEN_RATIO = (0.7, 0.14, 600)


@dataclass(frozen=True)
class Profile:
    name: str
    model: str  # served model name
    kv_tokens: int  # KV cache capacity in tokens
    max_model_len: int  # prompt + output limit per request
    step_base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    prefill_budget: int = 8192  # chunked prefill: tokens per step (decodes count 1 each)
    block_size: int = 16  # prefix-cache block (page) size in tokens
    max_running: int | None = 256  # vLLM max_num_seqs default; None: KV is the only limit
    decode_reserve: int = 128  # KV tokens reserved per request at admission for decode growth
    # SGLang's admission estimate instead of `decode_reserve`: (init ratio, min factor, decay
    # steps); each request reserves ratio × its remaining max_new_tokens (clipped at 4096), the
    # ratio decays per decode step and jumps back up on a retraction (bench/engine.py).
    # None: the fixed `decode_reserve` (vLLM-like). SGLang's defaults: (0.7, 0.14, 600).
    new_token_ratio: tuple[float, float, int] | None = None
    # vLLM's V1 scheduler admits waiting requests only while the step's token budget lasts
    # (vllm/v1/core/sched/scheduler.py: `while token_budget > 0`, after the running requests
    # took theirs), so a burst of long prompts waits a few steps with the batch far from full
    # and the KV nearly empty (seen live on vLLM 0.32; docs/results.md). False: admitted up to
    # `max_running` and the KV at once, their prefill chunked over the next steps.
    admit_within_budget: bool = False
    waiting_order: str = "fcfs"  # "fcfs", or "lpm": SGLang's longest-prefix-match order
    # How long reading the engine's load endpoint takes (a probe's latency, and what it costs
    # the engine's API server): vLLM renders /metrics in ~8 ms on an H200's host (6-17 ms on
    # vLLM 0.32's CPU server). 0: probes are instant and free, as the suite has always modelled
    # them; then the simulated LB re-probes after every push and answer, which a daemon facing
    # a costly endpoint does not (`lb.core.scheduler.wants_probe`, `probes.max_probe_share`).
    probe_s: float = 0.0
    # LoRA serving: how many adapters one batch runs (vLLM `--max-loras`, default 1; SGLang
    # `--max-loras-per-batch`, default 8). A waiting request whose adapter would make one more
    # is skipped until a running request of another adapter ends (vllm/v1/core/sched/
    # scheduler.py "max_loras constraint"; sglang scheduler.py `can_run_lora_batch`, a LoRA
    # request skipped, not the queue stopped, in current releases). None: no limit.
    max_loras: int | None = None
    output_median: int = 134  # without ignore_eos: lognormal output length (Azure conv median)
    output_sigma: float = 0.9
    source: str = ""
    reference: dict[str, tuple[object, str]] = field(default_factory=dict)

    def as_sglang(self, waiting_order: str = "lpm") -> "Profile":
        """The same hardware with SGLang's scheduler (ratio constants from
        sglang/srt/environ.py) and its `--schedule-policy`: "lpm" (longest cached prefix
        first; the default of older releases, and of SkyWalker's testbed) or "fcfs" (arrival
        order: the default of current releases, server_args `schedule_policy = "fcfs"`)."""
        suffix = "-sglang" if waiting_order == "lpm" else f"-sglang-{waiting_order}"
        return replace(self, name=f"{self.name}{suffix}", new_token_ratio=SGLANG_NEW_TOKEN_RATIO,
                       waiting_order=waiting_order)

    def with_overrides(self, **changes: object) -> "Profile":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# Llama-3-8B (config.json): 32 layers, 8 KV heads × 128 dims, bf16 → 2·32·8·128·2 B = 128 KiB
# of KV per token; 16 GB of weights; 2·8e9 = 16 GFLOP per prefill token.
_LLAMA3_8B = "meta-llama/Meta-Llama-3-8B-Instruct"

PROFILES: dict[str, Profile] = {
    "l4-llama3-8b": Profile(
        name="l4-llama3-8b",
        model=_LLAMA3_8B,
        # L4: 24 GB, 300 GB/s. 0.9·24 GB − 16 GB weights − ~1.6 GB activations ≈ 4 GiB of KV
        # = 32,768 tokens: ~24 Azure-conv requests (1,243 + 217 tokens on average) at once.
        kv_tokens=32_768,
        max_model_len=8192,
        # weights read per step: 16 GB / 300 GB/s ≈ 53 ms → ~18 tok/s at batch 1.
        step_base_s=0.055,
        # SkyWalker testbed: ~300 ms to prefill 512 tokens → (0.300 − 0.055) / 512 per token.
        prefill_token_s=0.00048,
        decode_seq_s=0.0003,
        context_token_s=128 * 1024 / 300e9,  # KV bytes per token / bandwidth
        prefill_budget=2048,  # SGLang's chunked-prefill size for small-memory GPUs
        source="SkyWalker (EuroSys'26) testbed as quoted in issue 2: ~300 ms prefill of 512 "
               "tokens on one L4, KV admitting ~20-50 concurrent chat requests; decode derived "
               "from L4 datasheet bandwidth (300 GB/s) and Llama-3-8B size",
        reference={
            "prefill_512_ms": (300, "SkyWalker testbed (issue 2)"),
            "decode_tps_b1": (18, "derived: 300 GB/s / 16 GB weights ≈ 19 steps/s"),
            "max_chat_concurrency": ("20-50", "SkyWalker testbed (issue 2)"),
        },
    ),
    "h100-llama3-8b": Profile(
        name="h100-llama3-8b",
        model=_LLAMA3_8B,
        # H100 SXM: 80 GB, 3.35 TB/s, 989 TFLOPS bf16 dense. 0.9·80 − 16 − ~6 GB ≈ 50 GB of KV
        # ≈ 400k tokens (SGLang logs max_total_num_tokens of this order for 8B on 80 GB).
        kv_tokens=400_000,
        max_model_len=8192,
        step_base_s=0.0065,  # 16 GB / 3.35 TB/s = 4.8 ms + launch overheads → ~150 tok/s
        prefill_token_s=16e9 / 500e12,  # 16 GFLOP/token at ~50 % MFU → 32 µs/token
        decode_seq_s=0.00005,
        context_token_s=128 * 1024 / 3.35e12,
        prefill_budget=8192,
        source="derived from the H100 SXM datasheet (3.35 TB/s, 989 TFLOPS bf16) and "
               "Llama-3-8B's config; ~50 % prefill MFU",
        reference={
            "prefill_512_ms": (23, "derived: 6.5 ms + 512 × 32 µs"),
            "decode_tps_b1": (150, "derived: 16 GB / 3.35 TB/s + overheads"),
            "max_chat_concurrency": (256, "max_num_seqs default; KV holds ~270 chat requests"),
        },
    ),
    "a100x8-llama2-70b": Profile(
        name="a100x8-llama2-70b",
        model="meta-llama/Llama-2-70b-chat-hf",
        # Llama-2-70B: 80 layers, 8 KV heads × 128 → 320 KiB/token; 140 GB of weights.
        # 8 × A100 80 GB (TP 8): 0.9·640 − 140 − ~40 GB ≈ 396 GB of KV ≈ 1.2M tokens.
        kv_tokens=1_200_000,
        max_model_len=4096,
        step_base_s=0.028,  # 140 GB / 16 TB/s = 9 ms + TP all-reduces (160 per step) → ~35 tok/s
        prefill_token_s=140e9 / 1.0e15,  # 140 GFLOP/token on 8 × 312 TFLOPS at ~40 % MFU
        decode_seq_s=0.0001,
        context_token_s=320 * 1024 / 16e12,
        prefill_budget=4096,
        source="derived from the A100 80GB datasheet (2.0 TB/s, 312 TFLOPS bf16, ×8 with TP) "
               "and Llama-2-70B's config; ~40 % prefill MFU",
        reference={
            "prefill_512_ms": (100, "derived: 28 ms + 512 × 0.14 ms"),
            "decode_tps_b1": (35, "derived: weight read + TP all-reduce latency"),
            "max_chat_concurrency": (256, "max_num_seqs default; KV holds far more"),
        },
    ),
    "tiny": Profile(
        name="tiny",
        model="tiny-llama",
        # Small KV so tests fill it with a handful of requests; fast steps.
        kv_tokens=2048,
        max_model_len=2048,
        step_base_s=0.004,
        prefill_token_s=0.00001,
        decode_seq_s=0.0001,
        context_token_s=0.0000001,
        prefill_budget=1024,
        max_running=None,
        decode_reserve=16,
        output_median=24,
        output_sigma=0.5,
        source="synthetic: for fast tests (4 ms steps, 2,048 KV tokens)",
        reference={},
    ),
}


# The L4 testbed with SGLang's scheduler (SkyWalker's engine): the same timing, SGLang's
# admission estimate, retraction and LPM waiting order.
PROFILES["l4-llama3-8b-sglang"] = PROFILES["l4-llama3-8b"].as_sglang()
PROFILES["l4-llama3-8b-sglang-fcfs"] = PROFILES["l4-llama3-8b"].as_sglang("fcfs")  # today's default order
PROFILES["tiny-sglang"] = PROFILES["tiny"].as_sglang()  # tests: SGLang's scheduler in small


SCHEDULE_POLICIES = ("fcfs", "lpm")  # SGLang `--schedule-policy` values the profiles model


def on_schedule_policy(name: str, policy: str) -> str:
    """The profile of `name`'s hardware on SGLang's scheduler with its waiting queue in `policy`'s
    order (`--schedule-policy`); ValueError naming the fix when `name` is not SGLang's."""
    if policy not in SCHEDULE_POLICIES:
        raise ValueError(f"schedule policy {policy!r}: one of {', '.join(SCHEDULE_POLICIES)}")
    if name not in PROFILES or PROFILES[name].new_token_ratio is None:
        sglang = ", ".join(n for n, p in PROFILES.items() if p.new_token_ratio is not None)
        raise ValueError(f"profile {name!r} does not model SGLang's scheduler; these do: {sglang}")
    base = name.removesuffix("-sglang-fcfs").removesuffix("-sglang")
    sibling = f"{base}-sglang" if policy == "lpm" else f"{base}-sglang-{policy}"
    if sibling not in PROFILES:
        raise ValueError(f"profile {name!r} has no sibling {sibling!r} with its queue in {policy} order")
    return sibling


def on_sglang(name: str) -> str:
    """The profile of `name`'s hardware on SGLang's scheduler as it ships (arrival order), for a
    fleet that runs it beside `name`; ValueError naming the fix when `name` runs SGLang's
    already or has no such sibling."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    if PROFILES[name].new_token_ratio is not None:
        raise ValueError(f"profile {name!r} runs SGLang's scheduler already")
    sibling = f"{name}-sglang-fcfs"
    if sibling not in PROFILES:
        raise ValueError(f"profile {name!r} has no sibling {sibling!r} on SGLang's scheduler (bench/profiles.py)")
    return sibling


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
