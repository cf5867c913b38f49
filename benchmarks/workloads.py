"""The allocator benchmark's workloads (bench_allocator.py): the anchor's mixed generate() workload
and a family of them, one per seed, both run on the GPU and as allocation traces for the CPU.

The pool met its fragmentation goal on the one workload it was tuned on (issue 18); a family keeps
it honest. A seed draws a model shape from real architectures (``ARCHS``), a mix (prefill-heavy:
long prompts, few new tokens; decode-heavy: short prompts, many new tokens; balanced), the calls
(batch, prompt, new tokens) and non-KV allocations interleaved with the steps (buffers a caller's
logits processors, streamers or side work keep for a few steps, some on a second stream).

``trace(workload)`` emits what greedy HF generate() with the dynamic cache allocates and frees
(weights first, freed last; per call a prefill and decode steps whose K/V grow by torch.cat: the
grown block is made, then the old one freed), in the format of the trace recorded on the H200
(tests/data/generate_trace.jsonl.gz): ``["a", size, id, stream]`` / ``["f", size, id, stream]``.
``layers=`` and ``max_new=`` cut a trace to CPU size (tests/test_pool_workloads.py,
bench_allocator.py ``--host``).

``run(mode, calls, seed)`` runs a workload's real generate() calls on the GPU in this process
under one allocator (``default``, ``expandable`` or ``oxygen``, installed before CUDA
initialises): seed None is the anchor's workload (``../shared/anchors/generate_mixed_workload.py``:
random-weight Llama-1.1B shape, bf16, sdpa, 14 (batch, prompt, new tokens) draws from
random.Random(1), greedy with min_new_tokens; the weights are made on the GPU in bf16, the same
tensors the anchor copies there, ~15 s less a process).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from dataclasses import dataclass, field

MiB = 1 << 20
BF16 = 2


@dataclass(frozen=True)
class Arch:
    """Decoder shape (the fields of a transformers config that allocation sizes depend on)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False  # lm_head shares the embedding

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Published configs (config.json of each model on the Hugging Face hub).
ARCHS = {
    a.name: a
    for a in (
        Arch("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, tied=True),
        Arch("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, tied=True),
        Arch("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256),
        Arch("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000),
        Arch("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, tied=True),
        Arch("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064),
        Arch("mistral-7b", 4096, 32, 32, 8, 14336, 32768),
    )
}

MIXES = ("prefill", "decode", "balanced")


@dataclass
class Workload:
    seed: int
    arch: Arch
    mix: str
    calls: list[tuple[int, int, int]]  # (batch, prompt tokens, new tokens)
    side_rate: float  # chance per decode step that a non-KV buffer is allocated
    notes: dict = field(default_factory=dict)

    def describe(self) -> str:
        toks = sum(b * n for b, _, n in self.calls)
        return (
            f"seed {self.seed}: {self.arch.name} ({self.arch.layers} layers, hidden "
            f"{self.arch.hidden}), {self.mix}, {len(self.calls)} calls, {toks} new tokens: "
            f"{self.calls}"
        )


def family(seed: int) -> Workload:
    """The workload of one seed (deterministic: same seed, same workload)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = random.Random(seed)
    arch = ARCHS[rng.choice(sorted(ARCHS))]
    mix = rng.choice(MIXES)
    calls = []
    for _ in range(rng.randint(6, 14)):
        b = rng.choice([1, 2, 4, 8, 16, 32])
        if mix == "prefill":
            p, n = rng.randint(512, 4096), rng.choice([8, 16, 32, 64])
        elif mix == "decode":
            p, n = rng.randint(16, 512), rng.choice([128, 256, 512])
        else:
            p, n = rng.randint(64, 2048), rng.choice([64, 128, 256])
        calls.append((b, p, n))
    return Workload(seed, arch, mix, calls, side_rate=rng.choice([0.0, 0.05, 0.2]))


class _Tracer:
    def __init__(self) -> None:
        self.ops: list[list] = []
        self.live: dict[int, tuple[int, int]] = {}
        self.spare: list[int] = []
        self.next = 0

    def alloc(self, n: int, stream: int = 0) -> int:
        i = self.spare.pop() if self.spare else self.next
        self.next += i == self.next
        self.live[i] = (n, stream)
        self.ops.append(["a", n, i, stream])
        return i

    def free(self, i: int) -> None:
        n, stream = self.live.pop(i)
        self.spare.append(i)
        self.ops.append(["f", n, i, stream])


def _weights(t: _Tracer, a: Arch, layers: int) -> None:
    kv = a.kv_heads * a.head_dim
    t.alloc(a.vocab * a.hidden * BF16)  # embedding
    for _ in range(layers):
        for n in (a.hidden * a.hidden, a.hidden * kv, a.hidden * kv, a.hidden * a.hidden,
                  a.hidden * a.intermediate, a.hidden * a.intermediate,
                  a.intermediate * a.hidden, a.hidden, a.hidden):  # fmt: skip
            t.alloc(n * BF16)
    t.alloc(a.hidden * BF16)  # final norm
    if not a.tied:
        t.alloc(a.vocab * a.hidden * BF16)


def _layer(t: _Tracer, a: Arch, kv: list, b: int, s: int, length: int, x: int) -> int:
    """One decoder layer of a step: s new tokens over `length` cached; returns the output."""
    d, h = a.head_dim, a.hidden
    tmp = [t.alloc(b * s * h * BF16), t.alloc(b * a.heads * s * d * BF16)]  # norm out, q
    k_new, v_new = t.alloc(b * a.kv_heads * s * d * BF16), t.alloc(b * a.kv_heads * s * d * BF16)
    for j in range(2):  # DynamicCache: torch.cat makes the grown block, then the old one goes
        grown = t.alloc(b * a.kv_heads * (length + s) * d * BF16)
        if kv[j] is not None:
            t.free(kv[j])
        kv[j] = grown
    t.free(k_new)
    t.free(v_new)
    att = t.alloc(b * s * h * BF16)
    for i in tmp:
        t.free(i)
    mlp = [t.alloc(b * s * a.intermediate * BF16), t.alloc(b * s * a.intermediate * BF16)]
    out = t.alloc(b * s * h * BF16)
    for i in mlp + [att]:
        t.free(i)
    t.free(x)
    return out


def trace(w: Workload, layers: int | None = None, max_new: int | None = None) -> list[list]:
    """The workload's alloc/free events. layers / max_new: cut the model's depth and each call's
    new tokens (CPU-sized replays); None keeps the workload's own."""
    a = w.arch
    nl = a.layers if layers is None else layers
    if nl < 1 or (max_new is not None and max_new < 1):
        raise ValueError(f"layers and max_new must be >= 1, got {layers!r} and {max_new!r}")
    rng = random.Random(w.seed * 7919 + 1)  # side buffers: their own draws, same per seed
    t = _Tracer()
    _weights(t, a, min(nl, a.layers))
    side: list[tuple[int, int]] = []  # (id, steps left) of non-KV buffers
    for b, p, new in w.calls:
        new = new if max_new is None else min(new, max_new)
        ids, mask = t.alloc(b * p * 8), t.alloc(b * p * 8)
        kv = [[None, None] for _ in range(min(nl, a.layers))]
        length = 0
        for step in range(new + 1):
            s = p if step == 0 else 1
            x = t.alloc(b * s * a.hidden * BF16)
            for layer in kv:
                x = _layer(t, a, layer, b, s, length, x)
            length += s
            logits = t.alloc(b * a.vocab * 4)  # last position only, as float
            t.free(x)
            tok = t.alloc(b * 8)
            t.free(logits)
            t.free(tok)
            if rng.random() < w.side_rate:  # 4 KiB - 64 MiB, log-uniform, a few steps
                n = int(4096 * 2 ** rng.uniform(0, 14))
                side.append((t.alloc(n, stream=rng.choice([0, 0, 1])), rng.randint(1, 64)))
            for i, _ in [e for e in side if e[1] <= 1]:
                t.free(i)
            side = [(i, k - 1) for i, k in side if k > 1]
        for layer in kv:
            for i in layer:
                t.free(i)
        t.free(ids)
        t.free(mask)
    for i, _ in side:
        t.free(i)
    for i in list(t.live):  # the model goes last: every block of a trace is freed
        t.free(i)
    return t.ops


def peak_live(ops: list[list]) -> int:
    """Peak of live bytes (each size rounded up to 512 B, as the pools count)."""
    live = peak = 0
    for op, size, _, _ in ops:
        n = max(512, (size + 511) // 512 * 512)
        live += n if op == "a" else -n
        peak = max(peak, live)
    return peak


# --- the real generate() calls on the GPU ------------------------------------------------------

ALLOCATORS = ("default", "expandable", "oxygen")


def anchor_calls(calls: int | None = None) -> list[tuple[int, int, int]]:
    """The anchor's 14 (batch, prompt, new tokens) draws, the first `calls` of them."""
    rng = random.Random(1)
    work = [
        (rng.choice([1, 4, 8, 16, 32]), rng.randint(64, 2048), rng.choice([64, 128, 256]))
        for _ in range(14)
    ]
    return work[:calls]


def _setup(mode: str):
    if mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if mode == "oxygen":
        from oxygen_torch import pool as allocator
        from oxygen_torch.config import PoolConfig

        cfg = PoolConfig()
        if os.environ.get("OXYGEN_HYSTERESIS_MS"):  # compare settings of pool.hysteresis_ms
            cfg = dataclasses.replace(cfg, hysteresis_ms=float(os.environ["OXYGEN_HYSTERESIS_MS"]))
        allocator.enable_allocator(cfg)
    return torch


def _build(torch, arch: Arch | None = None):
    """The anchor's Llama-1.1B shape, or `arch` (every shape is built as a Llama: same sizes, no
    Qwen attention bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000,
    )  # fmt: skip
    if arch is not None:
        shape = dict(
            hidden_size=arch.hidden, intermediate_size=arch.intermediate,
            num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
            num_key_value_heads=arch.kv_heads, vocab_size=arch.vocab,
            tie_word_embeddings=arch.tied,
        )  # fmt: skip
    cfg = LlamaConfig(**shape, max_position_embeddings=8192)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model, cfg


def run(mode: str, calls: int | None, seed: int | None = None) -> dict:
    """One workload under one allocator, in this process (before CUDA initialises): seed None is
    the anchor's workload, else the family's of that seed; `calls` keeps the first N calls."""
    fam = family(seed) if seed is not None else None
    work = anchor_calls(calls) if fam is None else fam.calls[:calls]
    torch = _setup(mode)
    model, cfg = _build(torch, fam.arch if fam else None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    toks = 0
    call_s = []  # each call's seconds (synchronized): where two allocators' times part
    t0 = time.perf_counter()
    for b, p, n in work:
        t = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (b, p), device="cuda")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        toks += b * n
        torch.cuda.synchronize()
        call_s.append(round(time.perf_counter() - t, 3))
    dt = time.perf_counter() - t0
    pa, pr = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    end_now = torch.cuda.memory_reserved()
    time.sleep(0.1)  # oxygen: idle pages leave after the hysteresis (pool.hysteresis_ms, 20 ms)
    r = {
        "mode": mode,
        "calls": len(work),
        "seed": seed,
        "arch": fam.arch.name if fam else "llama-1.1b (anchor)",
        "weights_GiB": round(base / 2**30, 3),
        "peak_alloc_GiB": round(pa / 2**30, 3),
        "peak_reserved_GiB": round(pr / 2**30, 3),
        "frag_pct": round(100 * (1 - pa / pr), 2),
        "end_reserved_GiB": round(end_now / 2**30, 3),
        "end_reserved_100ms_GiB": round(torch.cuda.memory_reserved() / 2**30, 3),
        "end_allocated_GiB": round(torch.cuda.memory_allocated() / 2**30, 3),
        "tok_per_s": round(toks / dt, 1),
        "seconds": round(dt, 1),
        "calls_bpn": [list(c) for c in work],  # (batch, prompt, new) of each call
        "call_s": call_s,
    }
    if mode == "oxygen":
        from oxygen_torch import pool as allocator

        s = allocator.memory_stats()
        r["oxygen"] = {k: s[k] for k in (
            "num_maps", "num_unmaps", "mean_map_latency_us", "mean_unmap_latency_us",
            "handles_created_inline", "reclaims", "pages_lent", "events_recorded",
            "handle_cache_pages", "idle_pages", "slab_cached_pages", "num_ooms")}  # fmt: skip
    return r
