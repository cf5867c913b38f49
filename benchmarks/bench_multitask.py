"""Many requests, one GPU: the same request trace through stock transformers and oxygen_torch.

A trace from a seed (examples/load.py's generator): gamma arrivals (coefficient of variation 1
and 4), about 20 % high priority, log-normal chat lengths (means ~160 in / ~340 out, capped at
2,048 / 1,024), 200 requests, Llama-1.1B shape bf16, greedy. Modes, each in its own process:

  stock_threads   stock transformers, one thread per request at its arrival
  stock_serial    stock transformers, one request after the other
  generate_batch  transformers' continuous batching (all requests given at once: it takes no
                  arrivals and no priorities)
  oxygen_fcfs     oxygen_torch.enable(), one thread per request, scheduler.policy=fcfs
  oxygen_wfq      the same with the weighted-fair policy (priorities from the trace)
  high_only       oxygen_wfq on the trace's high-priority requests alone (same arrivals): the
                  latency the high class would have with no low-priority load
  burst           oxygen_wfq with three times the arrival rate for the first 10 s

Per mode: total generated tok/s, per class TTFT and TPOT P50 / P99 and mean completion time,
peak GPU memory held, OOMs and lost requests; the worst over the trace seeds is reported.

    python benchmarks/bench_multitask.py                       # every mode, seeds 0 1, cv 1 4
    python benchmarks/bench_multitask.py --modes oxygen_wfq oxygen_fcfs --requests 100
    python benchmarks/bench_multitask.py --smoke               # tiny model on CPU: the plumbing

With --at-once K [K ...]: K generate() calls given at once against one batched generate() over
the same prompts and transformers' generate_batch (benchmarks/multitask_at_once.py):

    python benchmarks/bench_multitask.py --at-once 64 256 --shape vocab128k --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
from traces import Clock, EngineClock, pct, trace  # noqa: E402  (benchmarks/traces.py, beside)

MODES = ("stock_serial", "stock_threads", "generate_batch", "oxygen_fcfs", "oxygen_wfq",
         "high_only", "burst")  # fmt: skip
SMOKE = os.environ.get("BENCH_MULTITASK_SMOKE") == "1"
# --sleep-model "MS_A_STEP,MS_A_TOKEN": the tiny model on the CPU, each engine step also
# waited for as a GPU's would be (sleep_model)
SLEEP = os.environ.get("BENCH_MULTITASK_SLEEP")
# --no-forward (with --sleep-model): the model's forward stubbed (zeros logits), so a step's CPU
# is the engine's host work (and its callers'), as a GPU's replayed graphs leave it
NO_FORWARD = os.environ.get("BENCH_MULTITASK_NO_FORWARD") == "1"
SMOKE = SMOKE or bool(SLEEP)
DEVICE = "cpu" if SMOKE else "cuda"
# --profile-slow MS: the engine's launches that took this many ms of its thread's CPU, profiled
PROFILE_SLOW_MS = float(os.environ.get("BENCH_MULTITASK_PROFILE_SLOW") or 0)
# --profiler torch: those launches under torch.profiler (CPU): each aten op's own host time, the
# time inside the C++ calls (allocation, kernel launch) that cProfile shows only as one builtin
PROFILER = os.environ.get("BENCH_MULTITASK_PROFILER") or "cprofile"
# --no-warm-up: oxygen's trace modes skip oxygen_torch.warm_up() (every rows bucket's decode
# graph captured before the timed run, as a server does at its start)
NO_WARM_UP = os.environ.get("BENCH_MULTITASK_NO_WARM_UP") == "1"
# --engine-clock: oxygen's trace modes time tokens on the engine thread (traces.EngineClock, as
# `serve`'s streams are fed) instead of waking each caller every step for its streamer's put()
ENGINE_CLOCK = os.environ.get("BENCH_MULTITASK_ENGINE_CLOCK") == "1"
# --gil-holders PY_SPY: oxygen's trace modes sample which thread holds the interpreter lock
# during the timed run (py-spy record --gil --nonblocking on this process): the engine's launches
# that wait (their wall several times their CPU) wait for whoever holds it
GIL_HOLDERS = os.environ.get("BENCH_MULTITASK_GIL_HOLDERS")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=1024)  # fmt: skip
SPECK = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
             num_key_value_heads=1, vocab_size=256)  # fmt: skip


def build_model():
    import transformers as T

    torch.manual_seed(0)
    # (--sleep-model: smaller still, so that the CPU's compute of a step hardly grows with its
    # rows, as a 1B model's decode step on the H200 hardly does)
    shape = (TINY if not SLEEP else SPECK) if SMOKE else LLAMA_1B
    with torch.device(DEVICE):
        model = T.LlamaForCausalLM(T.LlamaConfig(**shape, max_position_embeddings=4096))
    model = model.to(torch.float32 if SMOKE else torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    if SLEEP:
        sleep_model(*map(float, SLEEP.split(",")))
    return model


def sleep_model(step_ms: float, token_ms: float) -> None:
    """--sleep-model: each engine step also takes `step_ms + token_ms * tokens` of a GPU that
    runs the steps one after the other, asynchronously: a step's tokens are read (its
    completion, after the next step's launch, as on CUDA) no sooner than its GPU time after
    the GPU was free, with the interpreter lock released meanwhile. Callers pass the engine's
    door as on a GPU."""
    from oxygen_torch.engine import door
    from oxygen_torch.engine.loop import Engine

    door.EVERY_DEVICE = True
    launch, complete, free = Engine._launch, Engine._complete, [0.0]

    def launched(self, rows):
        f = launch(self, rows)
        took = (step_ms + token_ms * sum(r.n for r in rows)) / 1e3
        free[0] = f.due = max(time.monotonic(), free[0]) + took
        return f

    def completed(self, f):
        time.sleep(max(0.0, getattr(f, "due", 0.0) - time.monotonic()))
        return complete(self, f)

    Engine._launch, Engine._complete = launched, completed
    if NO_FORWARD:
        no_forward()


def no_forward() -> None:
    """--no-forward: the engine runner's eager forward hands back zeros logits for the kept
    rows; the step's KV is still reserved, built and committed and its inputs staged (what a
    replayed graph's step costs the host, less the replay), the draw and delivery run. With
    OXYGEN_CONF=kv.cpu_decode_graphs:rerun the steps take the GPU's graph path (staging, pick,
    replay) and a replay of the CPU's stand-in graph runs nothing (its outputs stay the
    capture's), as a CUDA graph's replay costs the host one call."""
    from oxygen_torch.compile.cudagraphs import RerunGraph
    from oxygen_torch.integrations.hf.engine_runner import HFRunner

    def replay(self):
        self.replays += 1

    RerunGraph.replay = replay

    def eager(self, model, step, rows, ids, pos):
        _at, keep = self._inputs(rows, pos)
        vocab = model.get_output_embeddings().weight.shape[0]
        return torch.zeros(keep.shape[0], vocab, device=keep.device)

    HFRunner._eager = eager


def one(model, req: dict, start: float, oom: list) -> dict:
    import oxygen_torch

    time.sleep(max(0.0, start + req["at"] - time.monotonic()))
    x = torch.tensor([req["prompt_ids"]], device=DEVICE)
    clock, t0 = (EngineClock() if ENGINE_CLOCK else Clock()), time.monotonic()
    kw = dict(max_new_tokens=req["max_tokens"], min_new_tokens=req["max_tokens"], do_sample=False)
    try:
        with oxygen_torch.task(priority=req["priority"]), torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **kw)
    except torch.OutOfMemoryError:
        oom.append(1)
        return dict(req, ok=False)
    t = clock.times
    tpot = [(b - a) for a, b in zip(t, t[1:])]
    return dict(priority=req["priority"], ok=True, tokens=len(t), ttft=t[0] - t0 if t else None,
                tpot_p50=pct(tpot, 0.5), tpot_p99=pct(tpot, 0.99), done=time.monotonic() - t0,
                tpot=tpot)  # fmt: skip


def run_requests(model, reqs: list[dict], threaded: bool) -> tuple[list[dict], int, float]:
    results, oom, start = [], [], time.monotonic()
    if threaded:
        out = [None] * len(reqs)

        def work(i):
            out[i] = one(model, reqs[i], start, oom)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [r for r in out if r is not None]
    else:
        results = [one(model, dict(r, at=0.0), time.monotonic(), oom) for r in reqs]
    return results, len(oom), time.monotonic() - start


def run_batch(model, reqs: list[dict]) -> tuple[list[dict], int, float]:
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    new = max(r["max_tokens"] for r in reqs)
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.monotonic()
    out = model.generate_batch(inputs=[r["prompt_ids"] for r in reqs], generation_config=gc)
    took = time.monotonic() - t0
    results = [dict(priority=r["priority"], ok=True, tokens=len(o.generated_tokens), done=took)
               for r, o in zip(reqs, out.values())]  # fmt: skip
    return results, 0, took


def run_mode(mode: str, seed: int, cv: float, n: int) -> dict:
    import oxygen_torch

    oxygen = mode.startswith("oxygen") or mode in ("burst", "high_only")
    if oxygen:
        policy = "fcfs" if mode == "oxygen_fcfs" else "wfq"
        oxygen_torch.enable(scheduler={"policy": policy})
    model = build_model()
    rate = float(os.environ.get("BENCH_MULTITASK_RATE") or (4.0 if SMOKE else 8.0))
    cap_p, cap_n = (64, 256) if SLEEP else (40, 24) if SMOKE else (2048, 1024)
    reqs = trace(seed, n, rate, cv, 0.2, model.config.vocab_size, cap_p, cap_n)
    if mode == "burst":  # three times the rate for the first 10 s
        for r in reqs:
            r["at"] = r["at"] / 3 if r["at"] < 30 else r["at"] - 20
    # kernels compiled, graphs captured: 1, 2 and 8 rows at once (the engine's decode graphs
    # compile at their first rows bucket, at one row, and sizes symbolic at another)
    warm = [[dict(r, at=0.0, max_tokens=4) for r in reqs[:k]] for k in (1, 2, 8)]
    if mode == "high_only":
        reqs = [r for r in reqs if r["priority"] == "high"]
    for w in warm:
        run_requests(model, w, threaded=True)
    warmed = None
    if oxygen and not NO_WARM_UP:
        warmed = oxygen_torch.warm_up(
            model, max_length=min(cap_p + cap_n, model.config.max_position_embeddings)
        )
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    elif SLEEP and oxygen:  # the GPU host's heap frozen (scheduler.gc_freeze, a GPU's only):
        from oxygen_torch.engine import gc_watch  # else a full collection of ~0.2 s lands in

        gc_watch.freeze_once() or gc_watch.refreeze("the warm-up")  # some runs, not others
    import multitask_at_once as mo  # (beside this script)

    slow_launches = _profile_launches(PROFILE_SLOW_MS) if oxygen and PROFILE_SLOW_MS else None
    spy = _gil_sampler(mode) if oxygen and GIL_HOLDERS else None
    t0, compiles = time.perf_counter(), mo._compile_log()
    before = mo._graphs(model) if oxygen else {}
    captured, padded = before.get("captures", 0), before.get("padded", 0)
    mixed_before = mo._graphs(model, mixed=True) if oxygen else {}
    st_before = oxygen_torch.engine_stats(model) if oxygen else {}
    if mode == "generate_batch":
        results, oom, took = run_batch(model, reqs)
    else:
        results, oom, took = run_requests(model, reqs, threaded=mode != "stock_serial")
    peak = torch.cuda.max_memory_reserved() / 2**30 if DEVICE == "cuda" else 0.0
    out = summarize(mode, seed, cv, results, oom, took, peak, len(reqs))
    if spy is not None:
        out["gil_holders"] = spy()
    out["rate"] = rate
    if warmed is not None:  # (before the timed run)
        out["warm_up"] = {k: warmed[k] for k in ("captured", "mixed_captured", "table_blocks",
                                                 "seconds")}  # fmt: skip
    if oxygen:  # the engine's steps: how many, how full, the GPU's idle share between them
        st = oxygen_torch.engine_stats(model)
        out["steps"] = st.get("steps", 0)
        out["tokens_per_step"] = round(st.get("tokens", 0) / max(1, out["steps"]), 1)
        busy, idle = st.get("gpu_s", 0.0), st.get("gpu_idle_s", 0.0)
        out["gpu_idle"] = round(idle / (busy + idle), 3) if busy + idle else None
        out["per_call"] = st.get("per_call", {})
        # calls that waited for KV (preempted: recomputed, or swapped to the CPU tier), and the
        # callers' front door (its longest since the engine started, warm-up included: one
        # inside it holds a launching engine at the door)
        for k in ("preemptions", "swaps", "doors"):
            out[k] = st.get(k, 0) - st_before.get(k, 0)
        out["door_max_ms"] = round(1e3 * st.get("door_max_s", 0.0), 2)
        timeline = mo._timeline(model, since=t0)
        out["slow_steps"] = slow_steps(timeline)
        # how full the engine was: priorities change who finishes first only when calls wait
        # for a place in the steps (max_step_seqs) or for KV
        seqs = oxygen_torch.active_config().scheduler.max_step_seqs
        out["max_step_seqs"] = seqs
        out["full_steps"] = round(sum(e[1] >= seqs for e in timeline) / max(1, len(timeline)), 3)
        out["mean_rows"] = round(statistics.fmean(e[1] for e in timeline), 1) if timeline else 0
        g = mo._graphs(model)
        out["graph_captures"] = g.get("captures", 0) - captured
        out["graph_padded"] = g.get("padded", 0) - padded  # replays of a larger graph
        m = mo._graphs(model, mixed=True)  # kv.mixed_graphs: steps with prompt tokens
        out["mixed_graphs"] = {k: m.get(k, 0) - mixed_before.get(k, 0)
                               for k in ("captures", "replays", "padded", "failed")}  # fmt: skip
    if slow_launches is not None:
        out["slow_launches"] = slow_launches(mode)
    if compiles is not None:  # Triton kernels built in the timed run: (at ms, took ms, kernel)
        out["compiles"] = [(round(1e3 * (t - t0), 1), round(1e3 * d, 1), name[:80])
                           for t, d, name in compiles]  # fmt: skip
        mo._compile_log(stop=True)
    return out


SLOW_MS = 15.0  # a step this long is a slow one: a high row's token waits through all of it


def _gil_sampler(mode: str, rate: int = 250):
    """--gil-holders: py-spy (the path given) samples which thread holds the interpreter lock,
    `rate` times a second, without stopping the process, until the returned function is called
    (after the timed run); it returns gil_holders() of the samples, which also go raw to
    $OUT/gil_<mode>.txt (or a temporary file)."""
    import signal
    import tempfile

    out = Path(os.environ.get("OUT") or tempfile.mkdtemp()) / f"gil_{mode}.txt"
    cmd = [GIL_HOLDERS, "record", "--pid", str(os.getpid()), "--gil", "--threads",
           "--nonblocking", "--rate", str(rate), "--format", "raw",
           "--output", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # (attached before the timed run starts)

    def stop() -> dict:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"error": "py-spy did not stop"}
        if not out.exists():
            return {"error": (err or "")[-500:]}
        return gil_holders(out.read_text().splitlines())

    return stop


# oxygen_torch's threads other than the engines' (`oxygen-<model class>`), by name
OXYGEN_HELPERS = {"oxygen-cpu-tier", "oxygen-engine-receiver", "oxygen-engine-sender",
                  "oxygen-kv-ahead", "oxygen-metrics", "oxygen-metrics-accept",
                  "oxygen-metrics-idle", "oxygen-timeline"}  # fmt: skip


def gil_holders(lines: list[str], top: int = 12) -> dict:
    """py-spy's raw samples (`thread (tid): name;frame;...;frame count`) of the lock's holder,
    by kind of thread (the engines' `oxygen-<model class>` threads, the callers' `Thread-*`, the
    main one, others, oxygen_torch's own helpers included, by name) with each kind's share, and
    the callers' most sampled frames (the three innermost of oxygen_torch, or of anything when
    none is): what holds the lock the engine's launches wait for."""
    kinds: dict[str, int] = {}
    frames: dict[str, int] = {}
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        head, *calls = stack.split(";")
        name = head.split(":", 1)[1].strip() if ":" in head else head
        kind = ("engine" if name.startswith("oxygen-") and name not in OXYGEN_HELPERS
                else "caller" if name.startswith("Thread-")
                else "main" if name == "MainThread" else name)  # fmt: skip
        kinds[kind] = kinds.get(kind, 0) + int(n)
        if kind == "caller":
            ours = [c for c in calls if "oxygen_torch/" in c] or calls
            key = " < ".join(c.split(" (")[0] for c in ours[-3:][::-1])
            frames[key] = frames.get(key, 0) + int(n)
    total = sum(kinds.values()) or 1
    return {
        "samples": total,
        "share": {k: round(v / total, 3) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
        "callers_top": sorted(frames.items(), key=lambda x: -x[1])[:top],
    }


def _profile_launches(min_ms: float, keep: int = 6):
    """--profile-slow: every engine step's launch (Engine._launch) and its choice of rows
    (schedule.choose, as the loop calls it) under cProfile (or torch.profiler's CPU events,
    --profiler torch); the `keep` launches whose engine-thread CPU passed `min_ms` the most, and
    the `keep` choices whose wall time passed it the most (a choice that waited shows its CPU
    far below its wall), each's functions by cumulative and own time (aten ops by their own
    host time), go to $OUT/slow_launches_<mode>.txt. Returns a function that writes them and
    says how many launches and choices passed (the profiler slows every step: the run's figures
    are not figures)."""
    import cProfile
    import heapq
    import io
    import pstats

    from oxygen_torch.engine import loop

    real, real_choose = loop.Engine._launch, loop.choose
    kept, passed = {"launch": [], "choose": []}, {"launch": 0, "choose": 0}

    def profiler():
        if PROFILER == "torch":
            return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        return cProfile.Profile()

    def profiled(kind, fn, rows_of, *args):
        prof, cpu, wall = profiler(), time.thread_time(), time.perf_counter()
        on, off = (prof.start, prof.stop) if PROFILER == "torch" else (prof.enable, prof.disable)
        on()
        out = None
        try:
            out = fn(*args)
            return out
        finally:
            off()
            cpu = 1e3 * (time.thread_time() - cpu)
            wall = 1e3 * (time.perf_counter() - wall)
            ms = cpu if kind == "launch" else wall
            if ms >= min_ms:
                passed[kind] += 1
                rows = rows_of(args, out) or []
                what = (round(cpu, 2), round(wall, 2), len(rows), sum(r.n for r in rows))
                heapq.heappush(kept[kind], (ms, id(prof), what, prof))
                if len(kept[kind]) > keep:
                    heapq.heappop(kept[kind])

    def launch(self, rows):
        return profiled("launch", real, lambda a, out: a[1], self, rows)

    def choose(engine, budget):
        return profiled("choose", real_choose, lambda a, out: out, engine, budget)

    loop.Engine._launch, loop.choose = launch, choose

    def write(mode: str) -> dict:
        loop.Engine._launch, loop.choose = real, real_choose
        text = io.StringIO()
        for kind in ("choose", "launch"):
            for _ms, _, (cpu, wall, rows, tokens), prof in sorted(kept[kind], reverse=True):
                text.write(f"=== {kind}: engine-thread CPU {cpu:.1f} ms, wall {wall:.1f} ms, "
                           f"{rows} rows, {tokens} tokens\n")  # fmt: skip
                if PROFILER == "torch":
                    table = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                      row_limit=40)  # fmt: skip
                    text.write(table + "\n")
                    continue
                for order, n in (("cumulative", 45), ("tottime", 25)):
                    pstats.Stats(prof, stream=text).sort_stats(order).print_stats(n)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"slow_launches_{mode}.txt").write_text(text.getvalue())
        return dict(min_ms=min_ms, passed=passed["launch"],
                    choices_passed=passed["choose"],
                    kept=[k[2] for k in sorted(kept["launch"])[::-1]],
                    choices_kept=[k[2] for k in sorted(kept["choose"])[::-1]])  # fmt: skip

    return write


def slow_steps(timeline: list, limit: int = 40) -> dict:
    """The engine's steps of the timed run whose period (its start to the next one's, less the
    GPU's idle before the next one: an idle engine's waits for arrivals are not a slow step)
    passed SLOW_MS: how many, their ms, and the longest `limit` as (start ms, period ms, GPU idle
    after it ms, rows, tokens, choose / launch / complete ms, GPU ms, the engine thread's CPU ms
    in the launch, collection pause ms, its CPU ms in the choosing, the choosing's wait at the
    door ms, the launch's OS run-queue wait ms, its blocks, its preemptions): where a slow
    token's time went (a launch or a choosing far longer than its CPU ms waited: for a core,
    the interpreter lock, other threads' Python, a sync, a lock); and the slow steps' launches
    summed (`launch_waits`: CPU, run queue, blocked, the mean block). On a GPU a step after the
    engine paused (nothing to run: its GPU idle unknown) starts no period."""
    from multitask_at_once import launch_waits  # (beside this script)

    periods = []
    on_gpu = any(e[7] is not None for e in timeline)
    for a, b in zip(timeline, timeline[1:]):
        if on_gpu and b[7] is None:  # the engine paused in between: waits for arrivals
            continue
        idle = b[7] or 0.0
        periods.append((b[0] - a[0] - idle, idle, a))
    slow = sorted((p for p in periods if p[0] >= SLOW_MS), key=lambda p: -p[0])
    return dict(
        steps=len(timeline), slow=len(slow), slow_ms=round(sum(p[0] for p in slow), 1),
        median_ms=round(statistics.median(p[0] for p in periods), 3) if periods else None,
        longest=[(a[0], round(p, 2), round(idle, 2), *a[1:7], a[8], a[9], *a[10:15])
                 for p, idle, a in slow[:limit]],
        launch_waits=launch_waits([a for _p, _i, a in slow]),
    )  # fmt: skip


def summarize(mode, seed, cv, results, oom, took, peak, n) -> dict:
    ok = [r for r in results if r["ok"]]
    out = dict(mode=mode, seed=seed, cv=cv, requests=n, completed=len(ok), lost=n - len(results),
               oom=oom, tok_per_s=round(sum(r["tokens"] for r in ok) / took, 1),
               peak_GiB=round(peak, 2), seconds=round(took, 1))  # fmt: skip
    for cls in ("high", "low"):
        rs = [r for r in ok if r["priority"] == cls]
        if not rs:
            continue
        tpot = [t for r in rs for t in r.get("tpot", [])]
        out[cls] = dict(
            n=len(rs), ttft_p50=pct([r.get("ttft") for r in rs], 0.5),
            ttft_p99=pct([r.get("ttft") for r in rs], 0.99), tpot_p50=pct(tpot, 0.5),
            tpot_p99=pct(tpot, 0.99), mean_done=statistics.fmean(r["done"] for r in rs),
        )  # fmt: skip
    return out


def goals(rows: list[dict]) -> str:
    """The engine issue's trace goals for each seed and cv run with the modes they need: the
    high class's TTFT P99 / TPOT P99 under low-priority load against high_only (goal <= 1.15x),
    its mean completion against FCFS (goal >= 28 % lower), tok/s against FCFS (goal >= 0.95x),
    and the burst's OOMs and lost requests (goal 0 / 0)."""
    by = {(r["mode"], r["seed"], r["cv"]): r for r in rows if "error" not in r}
    lines = ["| seed | cv | high TTFT P99 x high_only | high TPOT P99 x high_only | "
             "high mean done x FCFS (goal <= 0.72x) | tok/s x FCFS | burst OOM / lost |",
             "|" + "---|" * 7]  # fmt: skip

    def ratio(a, b, fmt="{:.2f}x"):
        return fmt.format(a / b) if a is not None and b else "-"

    for seed, cv in sorted({(r["seed"], r["cv"]) for r in rows}):
        wfq, fcfs = by.get(("oxygen_wfq", seed, cv)), by.get(("oxygen_fcfs", seed, cv))
        alone, burst = by.get(("high_only", seed, cv)), by.get(("burst", seed, cv))
        if wfq is None:
            continue
        hi, alone_hi = wfq.get("high", {}), (alone or {}).get("high", {})
        fcfs_hi = (fcfs or {}).get("high", {})
        lower = ratio(hi.get("mean_done"), fcfs_hi.get("mean_done"))
        if fcfs is not None and not fcfs.get("full_steps"):
            # no FCFS step at max_step_seqs: no call waited for a place, so a policy had
            # nothing to reorder (the goal asks for a rate that keeps the engine full: --rate)
            lower += " (engine never full)"
        lines.append(
            f"| {seed} | {cv} | {ratio(hi.get('ttft_p99'), alone_hi.get('ttft_p99'))} | "
            f"{ratio(hi.get('tpot_p99'), alone_hi.get('tpot_p99'))} | {lower} | "
            f"{ratio(wfq['tok_per_s'], (fcfs or {}).get('tok_per_s'))} | "
            + (f"{burst['oom']} / {burst['lost']} |" if burst else "- |")
        )
    return "\n".join(lines)


def out_files(stem: str) -> tuple[Path, Path] | None:
    """($OUT/<stem>.json, .md), or the first <stem>_2, _3 ... not written yet: several runs in
    one device call (another OXYGEN_CONF, say) keep their own files. None without $OUT."""
    out = os.environ.get("OUT")
    if not out:
        return None
    n, name = 1, stem
    while Path(out, name + ".json").exists():
        n += 1
        name = f"{stem}_{n}"
    return Path(out, name + ".json"), Path(out, name + ".md")


def spawn(mode: str, seed: int, cv: float, n: int) -> dict:
    cmd = [sys.executable, __file__, "--run", mode, "--seed", str(seed), "--cv", str(cv),
           "--requests", str(n)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        return dict(mode=mode, seed=seed, cv=cv, error=proc.stderr[-2000:])
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    head = ("| mode | seed | cv | tok/s | done/lost/OOM | peak GiB | high TTFT P50/P99 s | "
            "high TPOT P50/P99 ms | high mean done s | low mean done s | "
            "steps (tokens a step; share of steps at max_step_seqs) |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['seed']} | {r['cv']} | error: "
                         f"{r['error'].strip().splitlines()[-1][:60]} ||||||||")  # fmt: skip
            continue
        h, lo = r.get("high", {}), r.get("low", {})
        lines.append(
            f"| {r['mode']} | {r['seed']} | {r['cv']} | {r['tok_per_s']} | {r['completed']}/"
            f"{r['lost']}/{r['oom']} | {r['peak_GiB']} | {h.get('ttft_p50', 0):.3f}/"
            f"{h.get('ttft_p99', 0):.3f} | {1e3 * h.get('tpot_p50', 0):.1f}/"
            f"{1e3 * h.get('tpot_p99', 0):.1f} | {h.get('mean_done', 0):.2f} | "
            f"{lo.get('mean_done', 0):.2f} | "
            + (
                f"{r['steps']} ({r['tokens_per_step']}; full {r.get('full_steps')}) |"
                if "steps" in r
                else "- |"
            )  # fmt: skip
        )
    return "\n".join(lines)


def floor_cell(r: dict) -> str:
    """The weight + KV read floor of a decode step of every row, and the decode step (GPU time
    where timed, else the wall time between steps) as a multiple of it (issue 34: ≤ 1.5x)."""
    f, step = r.get("floor"), r.get("decode_gpu_ms") or r.get("decode_step_ms")
    if not f:
        return "-"
    return f"{f['floor_ms']}" + (f" ({step / f['floor_ms']:.2f}x)" if step else "")


def at_once(args) -> None:
    rows, files = [], out_files("at_once")
    for seed in args.seeds:
        for k in args.at_once:
            for mode in args.at_once_modes:
                cmd = (
                    [
                        sys.executable,
                        __file__,
                        "--once",
                        f"{mode},{k},{seed}",
                        "--shape",
                        args.shape,
                        "--new",
                        args.new,
                    ]
                    + (["--sample"] if args.sample else [])
                    + (["--host-only"] if args.host_only else [])
                    + (["--profile"] if args.profile else [])
                    + (["--torch-allocator"] if args.torch_allocator else [])
                    + (["--record-allocs"] if args.record_allocs else [])
                    + (["--busy-python", str(args.busy_python)] if args.busy_python else [])
                )
                env = dict(os.environ, PYTHONPATH=str(HERE.parent))
                t = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                r = (
                    json.loads(lines[-1])
                    if lines
                    else dict(mode=mode, k=k, seed=seed, error=proc.stderr[-2000:])
                )
                r["conf"] = os.environ.get("OXYGEN_CONF", "")
                rows.append(r)
                print(f"[{time.time() - t:.0f}s] {json.dumps(r)[:600]}", flush=True)
                if files:  # as it goes: a call cut short keeps the runs done
                    files[0].write_text(json.dumps(rows))
    lines = [
        "| K | seed | mode | tok/s | x one_call | x generate_batch | peak GiB | steps | "
        "rows/step | host ms/step | wait ms/step | decode step ms | its launch ms | "
        "read floor ms (step x) | launch waits ms | door ms | gc ms (full) |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['k']} | {r['seed']} | {r['mode']} | error: "
                f"{r['error'].strip().splitlines()[-1][:80]} ||||||||||||||"
            )
            continue
        ref = {
            x["mode"]: x.get("tok_per_s")
            for x in rows
            if x.get("k") == r["k"] and x.get("seed") == r["seed"] and "error" not in x
        }
        ratio = [
            f"{r['tok_per_s'] / ref[m]:.2f}" if ref.get(m) else "-"
            for m in ("one_call", "generate_batch")
        ]
        lines.append(
            f"| {r['k']} | {r['seed']} | {r['mode']} | {r['tok_per_s']} | {ratio[0]} | "
            f"{ratio[1]} | {r['peak_GiB']} | {r.get('steps', '-')} | "
            f"{r.get('rows_per_step', '-')} | {r.get('host_ms_per_step', '-')} | "
            f"{r.get('wait_ms_per_step', '-')} | {r.get('decode_step_ms', '-')} | "
            f"{r.get('decode_launch_ms', '-')} | {floor_cell(r)} | "
            f"{r.get('launch_wait_ms', '-')} | {r.get('door_ms_mean', '-')} | "
            f"{r.get('gc_ms', '-')} ({r.get('gc_full', '-')}) |"
        )
    for r in rows:  # each mode against itself with the interpreter's own switch interval
        base = r["mode"][: -len("_stock_switch")] if r["mode"].endswith("_stock_switch") else None
        ours = [x for x in rows if x.get("mode") == base and x.get("k") == r["k"]
                and x.get("seed") == r["seed"] and "error" not in x]  # fmt: skip
        if base and ours and "error" not in r:
            lines.append(
                f"\nK {r['k']} seed {r['seed']} {base}: scheduler.switch_interval_ms default "
                f"{ours[0]['tok_per_s']} tok/s against the interpreter's own interval "
                f"{r['tok_per_s']}: {ours[0]['tok_per_s'] / r['tok_per_s']:.2f}x"
                + (
                    f" (beside {r['busy_python']} busy Python threads)"
                    if r.get("busy_python")
                    else ""
                )  # fmt: skip
            )
    md = "\n".join(lines)
    print("\n" + md)
    if files:
        files[0].write_text(json.dumps(rows))
        files[1].write_text(md + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                    help="modes to run (default: all)")  # fmt: skip
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1], help="trace seeds")
    ap.add_argument("--cvs", nargs="*", type=float, default=[1.0, 4.0],
                    help="coefficients of variation of the arrivals")  # fmt: skip
    ap.add_argument("--requests", type=int, default=200, help="requests in a trace")
    ap.add_argument("--rate", type=float, default=None,
                    help="mean arrivals a second of a trace (default 8: on the H200 the "
                         "Llama-1.1B shape then runs ~12 tokens a step; raise it, with "
                         "--requests, to keep the engine full)")  # fmt: skip
    ap.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cv", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 12 requests")
    ap.add_argument(
        "--profile-slow",
        type=float,
        metavar="MS",
        help="trace modes: every engine launch under cProfile; the slowest of those that took "
        "MS ms of the engine thread's CPU or more, profiled, to $OUT/slow_launches_<mode>.txt "
        "(the profiler slows every launch: the run's figures are not figures)",
    )
    ap.add_argument(
        "--profiler",
        choices=("cprofile", "torch"),
        default="cprofile",
        help="--profile-slow's profiler: cProfile (Python functions) or torch.profiler's CPU "
        "events (each aten op's own host time: allocation and kernel launch inside it)",
    )
    ap.add_argument(
        "--no-forward",
        action="store_true",
        help="with --sleep-model: the model's forward stubbed (zeros logits): each step's CPU "
        "is the engine's host work and its callers', as on a GPU whose steps replay graphs",
    )
    ap.add_argument(
        "--engine-clock",
        action="store_true",
        help="trace modes: time each token on the engine thread as it is read (how `serve`'s "
        "streams are fed) instead of each caller's streamer woken every step",
    )
    ap.add_argument(
        "--gil-holders",
        metavar="PY_SPY",
        help="trace modes: py-spy (this path) samples which thread holds the interpreter lock "
        "during the timed run (--gil, without stopping the process): each kind of thread's "
        "share and the callers' most sampled frames, in the JSON (raw: $OUT/gil_<mode>.txt)",
    )
    ap.add_argument(
        "--no-warm-up",
        action="store_true",
        help="trace and --at-once modes: skip oxygen_torch.warm_up() before the timed run (every "
        "rows bucket's decode graph and the mixed steps' graphs captured first, as `serve` "
        "does at its start)",
    )
    ap.add_argument(
        "--sleep-model", metavar="MS_A_STEP,MS_A_TOKEN",
        help="trace modes: the tiny model on the CPU, each step first sleeping this long with "
        "the interpreter lock released (a GPU's step as the host sees it: e.g. 2.5,0.005 for "
        "the Llama-1.1B shape on the H200); the requests as many as --requests",
    )  # fmt: skip
    ap.add_argument(
        "--at-once",
        nargs="*",
        type=int,
        default=None,
        metavar="K",
        help="K calls given at once (see above) instead of the arrival trace",
    )
    ap.add_argument(
        "--at-once-modes",
        nargs="*",
        default=["threads", "one_call", "generate_batch"],
        choices=[
            "threads",
            "one_call",
            "generate_batch",
            "threads_stock_switch",
            "one_call_stock_switch",
        ],
        help="modes of --at-once (default: the first three; *_stock_switch: with the "
        "interpreter's own switch interval, scheduler.switch_interval_ms 0)",
    )
    ap.add_argument(
        "--busy-python",
        type=int,
        default=0,
        metavar="N",
        help="--at-once: N threads running Python beside the timed run (the user's own)",
    )
    ap.add_argument(
        "--shape",
        default="vocab128k",
        choices=["llama1b", "vocab128k", "tiny"],
        help="model shape of --at-once (tiny: on CPU)",
    )
    ap.add_argument("--new", default="256", help="--at-once new tokens: a number or chat")
    ap.add_argument("--sample", action="store_true", help="--at-once: temperature 0.8, top_p 0.95")
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="--at-once threads/one_call: decode graph replays stubbed (zeros logits), so a "
        "step's time is the engine's host work alone (on CPU: the tiny shape)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="--at-once: the timed run under torch.profiler: the ops' CUDA and CPU tables "
        "to $OUT/profile_*.txt and a Chrome trace per run in $OUT (profiling slows the run: its "
        "tok/s is not a figure)",
    )
    ap.add_argument(
        "--torch-allocator",
        action="store_true",
        help="--at-once threads/one_call: oxygen_torch.enable() without its allocator route "
        "(PyTorch's caching allocator for activations; the KV pool as always): what the pool "
        "costs a step",
    )
    ap.add_argument(
        "--record-allocs",
        action="store_true",
        help="with --torch-allocator on a GPU: every allocation and free from the model's build "
        "to the timed run's end, to $OUT/allocs_<mode>_k<K>_s<seed>.jsonl.gz (the format of "
        "tests/data/generate_trace.jsonl.gz, each event with its time): the workload the pool "
        "meets, for replays on the host backend",
    )
    ap.add_argument(
        "--front-door",
        action="store_true",
        help="what one generate() call costs its caller before any forward: stock's generate() "
        "up to its first forward beside oxygen's front door up to its rows' submission (µs; "
        "--shape; on CPU with --shape tiny)",
    )
    ap.add_argument("--once", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.front_door:
        import multitask_at_once as mo

        dev = "cpu" if args.shape == "tiny" or not torch.cuda.is_available() else "cuda"
        r = mo.front_door(args.shape, dev)
        print(f"front door, {r['shape']} on {r['device']}, 1 row x {r['prompt']} tokens: "
              f"oxygen {r['oxygen_us']} µs, stock's generate() to its first forward "
              f"{r['stock_us']} µs, {r['ratio']}x")  # fmt: skip
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "front_door.json").write_text(json.dumps(r))
        return
    if args.once:
        import multitask_at_once as mo

        mode, k, seed = args.once.split(",")
        dev = "cpu" if args.shape == "tiny" else "cuda"
        mo.HOST_ONLY = args.host_only
        mo.PROFILE = args.profile
        mo.TORCH_ALLOCATOR = args.torch_allocator
        mo.RECORD_ALLOCS = args.record_allocs
        mo.BUSY = args.busy_python
        try:
            r = mo.run(mode, args.shape, int(k), int(seed), args.new, args.sample, dev)
        except Exception:  # noqa: BLE001 - reported in the table
            r = dict(mode=mode, k=int(k), seed=int(seed), error=traceback.format_exc()[-2000:])
        print(json.dumps(r), flush=True)
        return
    if args.at_once:
        at_once(args)
        return
    if args.rate is not None:  # (the modes' processes read it)
        if not args.rate > 0:
            ap.error(f"--rate: {args.rate} is not a positive number of arrivals a second")
        os.environ["BENCH_MULTITASK_RATE"] = str(args.rate)
    if args.sleep_model:
        try:
            a, b = map(float, args.sleep_model.split(","))
            assert a >= 0 and b >= 0
        except (ValueError, AssertionError):
            ap.error(f"--sleep-model: {args.sleep_model!r}; allowed: two numbers >= 0, "
                     "MS_A_STEP,MS_A_TOKEN")  # fmt: skip
        os.environ["BENCH_MULTITASK_SLEEP"] = args.sleep_model
        args.modes = [m for m in args.modes if m != "generate_batch"]
    if args.profiler != "cprofile" and args.profile_slow is None:
        ap.error("--profiler: profiles the slow launches of --profile-slow MS; give that too")
    if args.profile_slow is not None:
        if not args.profile_slow > 0:
            ap.error(f"--profile-slow: {args.profile_slow} is not a positive number of ms")
        os.environ["BENCH_MULTITASK_PROFILE_SLOW"] = str(args.profile_slow)
        os.environ["BENCH_MULTITASK_PROFILER"] = args.profiler
    if args.no_warm_up:
        os.environ["BENCH_MULTITASK_NO_WARM_UP"] = "1"
    if args.engine_clock:
        os.environ["BENCH_MULTITASK_ENGINE_CLOCK"] = "1"
    if args.gil_holders:
        os.environ["BENCH_MULTITASK_GIL_HOLDERS"] = args.gil_holders
    if args.no_forward:
        if not args.sleep_model:
            ap.error("--no-forward: stubs the forward of --sleep-model's CPU model; give that too")
        os.environ["BENCH_MULTITASK_NO_FORWARD"] = "1"
    if args.smoke:
        os.environ["BENCH_MULTITASK_SMOKE"] = "1"
        args.requests = min(args.requests, 12)
        args.modes = [m for m in args.modes if m != "generate_batch"]  # its paged path is CUDA
    if args.run:
        try:
            print(json.dumps(run_mode(args.run, args.seed, args.cv, args.requests)), flush=True)
        except Exception:  # noqa: BLE001 - reported in the table
            print(json.dumps(dict(mode=args.run, seed=args.seed, cv=args.cv,
                                  error=traceback.format_exc()[-2000:])))  # fmt: skip
        return
    rows, files = [], out_files("bench_multitask")
    for seed in args.seeds:
        for cv in args.cvs:
            for mode in args.modes:
                t = time.time()
                rows.append(spawn(mode, seed, cv, args.requests))
                rows[-1]["conf"] = os.environ.get("OXYGEN_CONF", "")
                print(f"[{mode} seed {seed} cv {cv}: {time.time() - t:.0f}s] "
                      f"{json.dumps(rows[-1])[:400]}", flush=True)  # fmt: skip
                if files:  # as it goes: a call cut short keeps the runs done
                    files[0].write_text(json.dumps(rows))
    md = table(rows) + "\n\n" + goals(rows)
    print("\n" + md)
    if files:
        files[0].write_text(json.dumps(rows))
        files[1].write_text(md + "\n")


if __name__ == "__main__":
    main()
