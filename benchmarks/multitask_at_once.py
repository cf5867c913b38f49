"""bench_multitask.py --at-once: K generate() calls given at once, against one batched call.

Workload from a seed: chat-like prompts (log-normal, mean ~200 tokens, cap 2,048), 256 new
tokens each (or `--new chat`: 128-512 each), random-weight model of a 1B class shape, bf16,
greedy or sampling (temperature 0.8, top_p 0.95). Modes, each in its own process:

  threads         oxygen_torch.enable(): K threads, each calling model.generate() on its prompt
  one_call        oxygen_torch.enable(): one generate() with the K prompts, left-padded (the
                  bound: one loop, the GPU's speed)
  generate_batch  transformers' continuous batching (generate_batch) over the same prompts
  threads_stock_switch, one_call_stock_switch
                  as threads / one_call with scheduler.switch_interval_ms 0: the interpreter's
                  own switch interval (5 ms) while the engine runs (with --busy-python: what
                  engine/switching.py is for)

`--busy-python N`: N threads beside the timed run, each a Python loop that never gives the
interpreter lock up by itself (the user's own Python: parsing, post-processing).

Each reports generated tok/s (tokens the requests asked for, over the wall time after a
warm-up of K requests with 16 new tokens each, then for oxygen's modes oxygen_torch.warm_up()
up to K rows unless --no-warm-up), GPU memory held at peak, and for the engine its
steps, host time a step and the timed run's step timeline (start, rows, tokens, choose / launch /
complete ms, on a GPU each step's GPU ms and the GPU's idle ms before it, and the engine
thread's CPU ms in the launch) in the JSON, with the weight + KV read floor of a decode step of
every row (`floor`: bytes over a copy's bandwidth measured in the same process; the table shows
the decode step as a multiple of it, issue 34's ≤ 1.5x).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-1.1B (TinyLlama) shape, 32k vocabulary
    "llama1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    # a 1B class shape with a 128k vocabulary (Llama-3.2-1B)
    "vocab128k": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      head_dim=64),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=1024),
}  # fmt: skip


def workload(seed: int, k: int, vocab: int, new: str, cap: int = 2048):
    rng = random.Random(seed)
    reqs = []
    for _ in range(k):
        p = min(cap, max(8, int(rng.lognormvariate(math.log(200) - 0.5, 1.0))))
        n = 256 if new == "256" else (rng.randint(128, 512) if new == "chat" else int(new))
        reqs.append(([rng.randrange(1, vocab) for _ in range(p)], n))
    return reqs


def build(shape: str, device: str):
    import transformers as T

    torch.manual_seed(0)
    with torch.device(device):
        model = T.LlamaForCausalLM(T.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096))
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


PROFILE = False  # --profile: the timed run under torch.profiler (tables to stderr, trace to $OUT)
TORCH_ALLOCATOR = False  # --torch-allocator: enable() leaves PyTorch's allocator in place
RECORD_ALLOCS = False  # --record-allocs (with --torch-allocator): the allocation trace to $OUT
HOST_ONLY = False  # --host-only: decode graph replays stubbed (the engine's host work alone)
BUSY = 0  # --busy-python N: threads running Python beside the timed run


@contextlib.contextmanager
def _busy(n: int):
    """n threads in a Python loop while the block runs: their loops a second in `counts`."""
    stop, counts = threading.Event(), []

    def spin():
        x, t = 0, time.perf_counter()
        while not stop.is_set():
            x += 1
        counts.append(x / (time.perf_counter() - t))

    ts = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    try:
        yield counts
    finally:
        stop.set()
        for t in ts:
            t.join()


def _stub_replays() -> None:
    """Decode steps replay nothing: a graph 'replay' hands back zeros logits (the staging and
    every other part of the step still run), so the step timeline is the host's work. On a CPU
    the graph path runs at all only with kv.cpu_decode_graphs, which run() sets for this."""
    from oxygen_torch.integrations.hf import merged_graphs

    zeros: dict = {}

    def run(self, model, forward, *_fusion, **_how):  # (a capture's fusion: none here)
        key = (self.rows, self.ids.device)
        if key not in zeros:
            zeros[key] = torch.zeros(self.rows, model.get_output_embeddings().weight.shape[0],
                                     device=self.ids.device)  # fmt: skip
        self.runner = self.runner or object()
        self.replays += 1
        return zeros[key]

    merged_graphs.MergedDecodeGraph.run = run


def sampling_kw(sample: bool) -> dict:
    return (
        dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0)
        if sample
        else dict(do_sample=False)
    )


def run(mode: str, shape: str, k: int, seed: int, new: str, sample: bool, device: str) -> dict:
    import oxygen_torch

    switch = {}
    if mode.endswith("_stock_switch"):  # the interpreter's own switch interval
        mode, switch = mode[: -len("_stock_switch")], {"switch_interval_ms": 0}
    if mode != "generate_batch":
        if TORCH_ALLOCATOR:  # the KV pool is its own arena: only activations change allocator
            from oxygen_torch import api

            api._attach_allocator = api._detach_allocator = lambda *a: None
        kv = {"cpu_decode_graphs": "rerun"} if HOST_ONLY else {}
        oxygen_torch.enable(kv=kv, scheduler={"engine": True, "decode_graphs": True, **switch})
        if HOST_ONLY:
            _stub_replays()
    if RECORD_ALLOCS and TORCH_ALLOCATOR and device == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    model = build(shape, device)
    reqs = workload(seed, k, model.config.vocab_size, new)
    kw = sampling_kw(sample)
    # warm-up: K requests of the same lengths' distribution, 16 new tokens each (Triton compiles
    # the prefill shapes and decode graphs are captured for K rows here, not in the timed run)
    warm = workload(seed + 1000, k, model.config.vocab_size, "16")
    if mode == "generate_batch":
        from transformers import GenerationConfig

        model.set_attn_implementation("paged|sdpa")

        def go(rs):
            gc = GenerationConfig(max_new_tokens=max(n for _, n in rs), eos_token_id=-1,
                                  pad_token_id=0, **kw)  # fmt: skip
            out = model.generate_batch(inputs=[p for p, _ in rs], generation_config=gc)
            return sum(len(o.generated_tokens) for o in out.values())
    elif mode == "one_call":

        def go(rs):
            width = max(len(p) for p, _ in rs)
            ids = torch.zeros(len(rs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(rs):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            n = max(m for _, m in rs)
            with torch.no_grad():
                out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                     max_new_tokens=n, min_new_tokens=n, **kw)  # fmt: skip
            return (out.shape[1] - width) * len(rs)
    else:

        def go(rs):
            got = [0] * len(rs)
            errors = []

            def work(i):
                p, n = rs[i]
                x = torch.tensor([p], device=device)
                try:
                    with torch.no_grad():
                        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
                    got[i] = out.shape[1] - len(p)
                except Exception as err:  # noqa: BLE001 - reported
                    errors.append(repr(err))

            ts = [threading.Thread(target=work, args=(i,)) for i in range(len(rs))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise RuntimeError(errors[0])
            return sum(got)

    go(warm)
    if k > 1:  # a second rows bucket: the engine's decode graphs compile their sizes symbolic
        go(warm[: k // 2])
    warmed = None
    if mode != "generate_batch" and os.environ.get("BENCH_MULTITASK_NO_WARM_UP") != "1":
        # oxygen_torch.warm_up(): the mixed steps' graphs too (a step with prompt tokens beside
        # decoding rows, which the threads' arrivals make or not from run to run: without it
        # such a step's first capture compiled its forward in the timed run, ~15 s on the H100
        # that every row waited through, 960 against 21,115 tok/s between two runs of one seed)
        longest = max(len(p) for p, _ in reqs) + max(n for _, n in reqs)
        warmed = oxygen_torch.warm_up(model, max_rows=k, max_length=longest)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _engine(model)
    counters = _pool_counters()
    compiles = _compile_log()
    captured = _graphs(model).get("captures", 0)
    mixed_captured = _graphs(model, mixed=True).get("captures", 0)
    t0 = time.perf_counter()
    with _profiled(f"{mode}_k{k}_s{seed}"), _busy(BUSY) as spins:
        tokens = go(reqs)
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    if RECORD_ALLOCS and TORCH_ALLOCATOR and device == "cuda":
        _write_allocs(f"{mode}_k{k}_s{seed}", shape, t0, took)
    out = dict(mode=mode, shape=shape, k=k, seed=seed, new=new, sample=sample,
               tok_per_s=round(tokens / took, 1), tokens=tokens, seconds=round(took, 2),
               peak_GiB=round(_held() / 2**30, 2))  # fmt: skip
    if switch:
        out["mode"] = f"{mode}_stock_switch"
    if BUSY:  # the busy threads' Python loops a second, all together
        out["busy_python"], out["busy_loops_per_s"] = BUSY, round(sum(spins))
    if TORCH_ALLOCATOR:
        out["allocator"] = "torch"
    if counters:  # the pool's page maps and allocations during the timed run
        now = _pool_counters()
        out["pool"] = {k: now[k] - counters[k] for k in counters}
    after = _engine(model)
    if compiles is not None:  # Triton kernels built during the timed run (each ~0.2-2 s)
        out["compiles"] = [(round(1e3 * (t - t0), 1), round(1e3 * d, 1), name)
                           for t, d, name in compiles]  # fmt: skip
        _compile_log(stop=True)
    timeline = _timeline(model, since=t0)
    eng = _model_engine(model)
    first = [x[0] for x in eng.stats.timeline if x[0] >= t0] if eng is not None else []
    if first:  # the run's wall time before the engine's first step, and after its last launch
        out["first_step_ms"] = round(1e3 * (first[0] - t0), 1)
        out["after_last_step_ms"] = round(1e3 * (t0 + took - first[-1]), 1)
    graphs = _graphs(model)
    if graphs:
        out["graph_captures"] = graphs["captures"] - captured
        # (a step with prompt tokens in a tokens bucket no warm-up step had: its graph captured
        # and its forward compiled in the timed run, seconds that every row waits through)
        out["mixed_captures"] = _graphs(model, mixed=True).get("captures", 0) - mixed_captured
    if warmed is not None:
        out["warm_up"] = {x: warmed[x] for x in ("captured", "mixed_captured", "seconds")
                          if x in warmed}  # fmt: skip
    if timeline:
        out["timeline"] = timeline[-400:]
        full = [x for x in timeline if x[1] == x[2] == k]  # decode steps of every row
        if len(full) > 1:
            gaps = sorted(b[0] - a[0] for a, b in zip(full, full[1:]) if b[0] - a[0] < 1e3)
            out["decode_step_ms"] = round(gaps[len(gaps) // 2], 3) if gaps else None
            out["decode_launch_ms"] = round(sorted(x[4] for x in full)[len(full) // 2], 3)
            gpu = sorted(x[6] for x in full if x[6] is not None)
            out["decode_gpu_ms"] = gpu[len(gpu) // 2] if gpu else None
            if not HOST_ONLY:  # (the step within 1.5x of it: issue 34's goal)
                out["floor"] = read_floor(model, reqs, device)
        mixed = [x for x in timeline if x[2] > x[1]]  # steps with prefill chunks
        if mixed:  # the longest: its launch (host) beside its GPU time (a sync shows as both)
            worst = max(mixed, key=lambda x: x[4])
            out["mixed_steps"], out["worst_mixed"] = len(mixed), worst
            out["mixed_gpu_ms"] = round(sum(x[6] or 0 for x in mixed), 1)
        # launches' wall time the engine thread did not run (its CPU time short of the wall):
        # waits for the interpreter lock while callers' threads run Python, or device syncs
        out["launch_wait_ms"] = round(sum(x[4] - x[8] for x in timeline if x[8] is not None), 1)
        out["launch_waits"] = launch_waits(timeline)
    if after:
        steps = after["steps"] - before.get("steps", 0)
        out["steps"] = steps
        out["rows_per_step"] = round((after["drawn"] - before.get("drawn", 0)) / max(steps, 1), 1)
        out["host_ms_per_step"] = round(1e3 * (after["host_s"] - before.get("host_s", 0))
                                        / max(steps, 1), 3)  # fmt: skip
        for k in ("choose_s", "complete_s"):
            out[k.replace("_s", "_ms_per_step")] = round(
                1e3 * (after[k] - before.get(k, 0)) / max(steps, 1), 3
            )
        out["wait_ms_per_step"] = round(1e3 * (after["wait_s"] - before.get("wait_s", 0))
                                        / max(steps, 1), 3)  # fmt: skip
        if "gc_s" in after:  # the interpreter's collection pauses during the run (any thread)
            out["gc_ms"] = round(1e3 * (after["gc_s"] - before.get("gc_s", 0)), 1)
            out["gc_full"] = after["gc_full"] - before.get("gc_full", 0)
        # an idle engine's wait for the burst's callers before its first step
        out["burst_wait_ms"] = round(1e3 * (after.get("burst_wait_s", 0)
                                            - before.get("burst_wait_s", 0)), 1)  # fmt: skip
        doors = after.get("doors", 0) - before.get("doors", 0)
        if doors:  # the callers' front door: generate() called -> rows submitted
            out["door_ms_mean"] = round(1e3 * (after["door_s"] - before.get("door_s", 0))
                                        / doors, 3)  # fmt: skip
    return out


def read_floor(model, reqs: list, device: str, copy_bytes: int = 256 << 20) -> dict:
    """Issue 34's floor of a decode step of every row: the bytes the step must read at least --
    every weight but the input embedding (a step reads K of its rows; counted when it is the
    output head's too) and each row's K and V at its mean length over the run (prompt + half
    its new tokens, left padding not counted) -- over the bandwidth of a device-to-device copy
    measured here in the same process (read + write bytes a second, as bench_attention's
    "copy (ceiling)" rows)."""
    import oxygen_torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, weights = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        at = t.untyped_storage().data_ptr()
        if at in seen or (t is emb and at != head.untyped_storage().data_ptr()):
            continue
        seen.add(at)
        weights += t.untyped_storage().nbytes()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    conf = oxygen_torch.active_config()
    fp8 = conf is not None and str(conf.kv.kv_dtype).startswith("fp8")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
    per_token *= 1 if fp8 else head.element_size()
    kv = int(sum(len(p) + n / 2 for p, n in reqs) * per_token)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(12):
        sync()
        t = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        sync()
        times.append((time.perf_counter() - t) / 5)
    bw = 2 * src.nbytes / sorted(times)[len(times) // 2]
    del src, dst
    return dict(weight_bytes=weights, kv_bytes=kv, copy_bytes_per_s=int(bw),
                floor_ms=round(1e3 * (weights + kv) / bw, 3))  # fmt: skip


@contextlib.contextmanager
def _profiled(name: str):
    """--profile: the block under torch.profiler (CPU and CUDA activity, every thread's ops):
    the top ops by CUDA time and by CPU self time printed to stderr, a Chrome trace to $OUT."""
    if not PROFILE:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # every thread's ops (the engine thread's above all), and the device syncs as events
    from torch._C._profiler import _ExperimentalConfig

    extra = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    with profile(activities=acts, experimental_config=extra) as prof:
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    text = (
        f"--- {name}: the device's time by part\n{parts_table(prof.events(), wall)}\n"
        f"--- {name}: by {sort}\n"
        + ka.table(sort_by=sort, row_limit=40, max_name_column_width=60)
        + f"\n--- {name}: by self CPU time\n"
        + ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    )
    print(text, file=sys.stderr)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"profile_{name}.txt").write_text(text)
        trace = Path(out, f"trace_{name}.json")
        prof.export_chrome_trace(str(trace))
        import gzip
        import shutil

        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)  # (the device tool returns files of bounded size)
        trace.unlink()


# a kernel's part of a step, by its name (first match); Triton kernels of ours by their names
# (triton_kernels/), Inductor's fused ones start with "triton_"
PARTS = (
    (
        "attention",
        re.compile(
            r"_decode_kernel|_prefill_kernel|_dense_kernel|_combine_kernel|"
            r"flash|fmha|attention",
            re.I,
        ),
    ),  # fmt: skip
    ("kv writes", re.compile(r"_append_kernel|_store|kv_write|_reset_scales|_amax", re.I)),
    (
        "matmuls",
        re.compile(
            r"gemm|cutlass|xmma|nvjet|cublas|splitk|sm90_|sm80_|matmul|_mm_|"
            r"aten::(addmm|mm|bmm|linear)$",
            re.I,
        ),
    ),  # fmt: skip
    (
        "logits, sampling",
        re.compile(
            r"argmax|topk|sort|softmax|cumsum|_sample_kernel|gumbel|"
            r"index_put|masked_fill|scatter|gather",
            re.I,
        ),
    ),  # fmt: skip
    # (before copies: Inductor names a fusion by its ops, "triton_poi_fused__to_copy_..._cos")
    ("fused elementwise (norms, rotary, activations)", re.compile(r"^triton_", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy", re.I)),
)
# device-side records that are no kernel: the profiler's waits on CUDA events (on the H100 they
# were 24-30 % of the "device time" of a step's profile at 1 and 64 rows)
NOT_KERNELS = re.compile(r"^Event Sync$")


def parts_table(events, wall_s: float | None = None) -> str:
    """The device time of the kernels in `events` (torch.profiler's) by part of a step (PARTS;
    the rest is "other"): total ms and share, and the share of `wall_s` the device was not
    running them (the host's part, and the gaps); on a machine with no device, the CPU ops'."""
    from torch.autograd import DeviceType

    kernels = [e for e in events
               if e.device_type == DeviceType.CUDA and not NOT_KERNELS.match(e.name)]  # fmt: skip
    use = kernels or [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_children]
    total: dict[str, float] = {}
    for e in use:
        us = e.device_time_total if kernels else e.cpu_time
        part = next((n for n, rx in PARTS if rx.search(e.name)), "other")
        total[part] = total.get(part, 0.0) + us
    whole = sum(total.values()) or 1.0
    rows = ["| part | ms | share |", "|---|---|---|"]
    for part, us in sorted(total.items(), key=lambda kv: -kv[1]):
        rows.append(f"| {part} | {us / 1e3:.1f} | {100 * us / whole:.1f} % |")
    what = "kernels" if kernels else "CPU ops (no device kernels recorded)"
    tail = f"\n({len(use)} {what}, {whole / 1e3:.1f} ms in all"
    if kernels and wall_s:
        busy = min(1.0, whole / 1e6 / wall_s)
        tail += f"; of {1e3 * wall_s:.1f} ms of wall, no kernel ran {100 * (1 - busy):.1f} %"
    return "\n".join(rows) + tail + ")"


def _compile_log(stop: bool = False):
    """Triton compiles from now on, as (start, seconds, kernel and specialization) (None where
    Triton has no compile hooks)."""
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - an older Triton: no hooks
        return None
    if stop:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
        return None
    log, open_ = [], {}

    def pre(*, key, repr, fn, **_):
        open_[id(fn.jit_function), str(key)] = time.perf_counter()
        return False

    def post(*, key, repr, fn, **_):
        t = open_.pop((id(fn.jit_function), str(key)), None)
        if t is not None:
            log.append((t, time.perf_counter() - t, repr[:400]))

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post
    return log


def _model_engine(model):
    """The engine serving `model` (None in transformers' own mode or before its first call)."""
    try:
        from oxygen_torch.integrations.hf import engine_runner
    except Exception:  # noqa: BLE001 - transformers' own mode
        return None
    group = engine_runner._engines.get(model) or {}
    return next(iter(group.values()), None)


def launch_waits(timeline: list) -> dict:
    """Where the launches of `timeline` (_timeline's entries) spent their wall time, ms: the
    engine thread's CPU, its wait in the OS run queue (another thread had its core), and the
    rest blocked (the interpreter lock, a lock, a device sync), with its blocks and preemptions
    and the mean block (engine/thread_clock.py): ~the switch interval a block is the lock taken
    back after torch ops while other threads run Python; one long block, a sync or a lock."""
    xs = [x for x in timeline if x[8] is not None and len(x) > 14]
    if not xs:
        return {}
    wall, cpu = sum(x[4] for x in xs), sum(x[8] for x in xs)
    known = [x for x in xs if x[12] is not None]
    runq = sum(x[12] for x in known) if known else None
    blocks = sum(x[13] or 0 for x in xs)
    blocked = wall - cpu - (runq or 0.0)
    return dict(launches=len(xs), wall_ms=round(wall, 1), cpu_ms=round(cpu, 1),
                runq_ms=None if runq is None else round(runq, 1), blocked_ms=round(blocked, 1),
                blocks=blocks, preempted=sum(x[14] or 0 for x in xs),
                mean_block_ms=round(blocked / blocks, 3) if blocks else None)  # fmt: skip


def _timeline(model, since: float = 0.0) -> list:
    """The engine's step timeline from perf_counter time `since` (the timed run's start)."""
    eng = _model_engine(model)
    if eng is None:
        return []
    t = [x for x in eng.stats.timeline if x[0] >= since]
    t0 = t[0][0] if t else 0

    def ms(x):
        return None if x is None else round(1e3 * x, 3)

    # (start ms, rows, tokens, choose / launch / complete ms, GPU ms, GPU idle ms before it,
    # the engine thread's CPU ms in the launch, the interpreter's collection pauses in the step,
    # the engine thread's CPU ms in the choosing, the choosing's wait at the door ms; then of
    # the launch: the engine thread's OS run-queue wait ms, its blocks and its preemptions)
    return [(round(1e3 * (a - t0), 2), r, n, ms(c), ms(la), ms(co), ms(g), ms(i), ms(cpu),
             *(ms(v) for v in (x + [None] * 4)[:4]), *(x + [None] * 6)[4:6])
            for a, r, n, c, la, co, g, i, cpu, *x in t]  # fmt: skip


def _graphs(model, mixed: bool = False) -> dict:
    """The engine's decode graphs' figures (`mixed`: its mixed steps' graphs, kv.mixed_graphs)."""
    eng = _model_engine(model)
    if eng is None:
        return {}
    return (eng.runner.mixed if mixed else eng.runner.graphs).stats()


def _engine(model) -> dict:
    try:
        from oxygen_torch.integrations.hf import engine_runner
    except Exception:  # noqa: BLE001 - transformers' own mode
        return {}
    return engine_runner.engine_stats(model)


def _write_allocs(name: str, shape: str, t0: float, took: float) -> None:
    """The recorded allocations and frees (PyTorch's memory history) as an oxygen-alloc-trace:
    a JSON header, then ["a" | "f", size, id, stream, ns since the first event] a line."""
    import gzip
    import json

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    ids, streams, lines, made = {}, {}, [], 0
    first = events[0]["time_us"] if events else 0
    timed_from = None  # the timed run's first event (perf_counter and the trace's clock differ)
    wall0 = time.time() - (time.perf_counter() - t0)  # the timed run's start, wall clock
    for e in events:
        act = e["action"]
        if act not in ("alloc", "free_requested"):
            continue
        addr, size = e["addr"], e["size"]
        s = streams.setdefault(e.get("stream", 0), len(streams))
        if act == "alloc":
            i = ids[addr] = made
            made, op = made + 1, "a"
        elif addr in ids:
            i, op = ids.pop(addr), "f"
        else:
            continue
        if timed_from is None and e["time_us"] / 1e6 >= wall0:
            timed_from = len(lines)
        lines.append([op, size, i, s, (e["time_us"] - first) * 1000])
    head = dict(format="oxygen-alloc-trace/1", what=f"bench_multitask --at-once {name}, {shape}",
                torch=torch.__version__, gpu=torch.cuda.get_device_name(), events=len(lines),
                streams=len(streams), timed_from=timed_from, timed_seconds=round(took, 3),
                free_action="free_requested", time_unit="ns")  # fmt: skip
    out = os.environ.get("OUT", ".")
    with gzip.open(Path(out, f"allocs_{name}.jsonl.gz"), "wt") as f:
        f.write(json.dumps(head) + "\n")
        for x in lines:
            f.write(json.dumps(x) + "\n")


def _pool_counters() -> dict:
    """The global pool's map / unmap / allocation counters ({} without the pool's route)."""
    if not torch.cuda.is_available() or TORCH_ALLOCATOR:
        return {}
    from oxygen_torch.pool import stats

    raw = stats.memory_stats()
    keys = (
        "num_maps",
        "num_unmaps",
        "map_ns",
        "unmap_ns",
        "num_allocs",
        "reclaims",
        "pool_maps",
        "pool_unmaps",
        "pool_map_ns",
        "pool_unmap_ns",
    )  # (num_*: KV arenas too)
    return {k: raw.get(k, 0) for k in keys}


def _held() -> int:
    """Peak GPU memory held (after enable(), the pool's peak mapped bytes answer this)."""
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


class _FirstForward(Exception):
    """Raised by a stubbed forward: stock's generate() got as far as its first forward."""


def front_door(shape: str, device: str, prompt: int = 200, calls: int = 50,
               repeats: int = 40) -> dict:  # fmt: skip
    """What one generate() call costs its caller before any forward, in µs (min over `repeats`
    rounds of `calls` calls, one thread): stock transformers' generate() up to its first
    forward (its model's forward stubbed to raise there), beside oxygen's front door up to the
    submission of the call's rows (after enable(); the engine's run stubbed). A 1-row greedy
    call of `prompt` tokens, 4 new tokens asked. Each of the 64-256 callers of `--at-once`
    runs this under the interpreter lock before its rows reach the engine."""
    import timeit

    from oxygen_torch.config import load_config
    from oxygen_torch.integrations.hf import front
    from oxygen_torch.integrations.hf import integration as hf

    model = build(shape, device)
    ids = torch.randint(1, SHAPES[shape]["vocab_size"], (1, prompt), device=device)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
              do_sample=False)  # fmt: skip

    def stopped(*_a, **_k):
        raise _FirstForward

    def stock_call():
        try:
            model.generate(**kw)
        except _FirstForward:
            pass

    def timed(fn) -> float:
        with torch.no_grad():
            fn()
            best = min(timeit.repeat(fn, number=calls, repeat=repeats))
        return 1e6 * best / calls

    model.forward = stopped  # (an instance attribute: stock's generate() calls it)
    stock = timed(stock_call)
    del model.forward
    hf.apply(model, load_config(scheduler={"engine": True}))
    with torch.no_grad():
        model.generate(**kw)  # (the engine made; the memo warm)
    run = front.run
    front.run = lambda engine, plan, entered=None, arrival=None: plan
    try:
        ours = timed(lambda: model.generate(**kw))
    finally:
        front.run = run
    return {"stock_us": round(stock, 1), "oxygen_us": round(ours, 1),
            "ratio": round(ours / stock, 3), "prompt": prompt, "shape": shape,
            "device": device}  # fmt: skip
