"""A family of mixed generate() workloads, one per seed, as allocation traces.

The pool met its fragmentation goal on the one workload it was tuned on (issue 18); a family keeps
it honest. A seed draws a model shape from real architectures (``ARCHS``), a mix (prefill-heavy:
long prompts, few new tokens; decode-heavy: short prompts, many new tokens; balanced), the calls
(batch, prompt, new tokens) and non-KV allocations interleaved with the steps (buffers a caller's
logits processors, streamers or side work keep for a few steps, some on a second stream).

``trace(workload)`` emits what greedy HF generate() with the dynamic cache allocates and frees
(weights first, freed last; per call a prefill and decode steps whose K/V grow by torch.cat: the
grown block is made, then the old one freed), in the format of benchmarks/record_trace.py:
``["a", size, id, stream]`` / ``["f", size, id, stream]``. ``layers=`` and ``max_new=`` cut a
trace to CPU size (tests/test_pool_workloads.py); bench_allocator.py ``--seeds`` runs the same
seeds on the GPU (mixed_workload.run_seed) and replays them on the host backend
(``--replay-host``).

    python benchmarks/workloads.py 0 1 2        # print each seed's workload
"""

from __future__ import annotations

import random
import sys
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


def main(argv: list[str]) -> int:
    for s in [int(x) for x in argv] or list(range(8)):
        print(family(s).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
