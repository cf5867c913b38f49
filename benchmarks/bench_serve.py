"""The server under load: an arrival trace at rising rates, through `python -m oxygen_torch serve`
(streamed and not) and in-process (generate() threads, as bench_multitask.py), per class.

    python benchmarks/bench_serve.py --smoke                     # tiny model on CPU: the plumbing
    python benchmarks/bench_serve.py                             # H200: 1B-class shape, bf16
    python benchmarks/bench_serve.py --rates 4 8 16 32 --requests 200 --cv 1
    python benchmarks/bench_serve.py --checkpoint /models/llama --conf kv.prefix_cache:true

The trace is benchmarks/traces.py's (gamma arrivals, ~20 % high priority, log-normal chat
lengths; min_tokens = max_tokens so every request makes exactly its tokens), on a random-weight
checkpoint written to a temporary directory (a word-level tokenizer built offline, no EOS) or on
--checkpoint. Modes, at each rate (one server per rate for both server modes, a fresh process
for in-process; each warmed up by a few short requests at once and then, unless
--no-warm-trace, by the trace itself untimed, so no timed mode captures decode graphs the
other then reuses):

  stream     the server, stream: true. TTFT: request sent to first text chunk; TPOT: (last chunk
             - first chunk) / (tokens - 1), per request
  whole      the server, not streamed: only the request's whole time
  stream_1p  stream and whole against `serve --one-process` (the model in the HTTP server's own
  whole_1p   process): what the engine process of its own gains
  inprocess  the same trace as generate() threads in one process, timed by a streamer

Per mode and rate: generated tok/s (first arrival to last answer), per class TTFT and TPOT P50 /
P99 and mean request time, failures, and the serving processes' CPU time per generated token
(every thread of the server and its engine process: the engine's, the requests', the event
loop's; in-process, the trace's client threads too; `engine_cpu_us_per_token`: the engine
process's alone). Rates rise until the stream mode's TTFT P99 passes
--ttft-limit. The goals (issue 33): the server within 10 % of in-process throughput at the same
rate; streaming adds at most 1 ms to TPOT P50 (the stream mode's beside in-process's).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from traces import Clock, pct, trace  # noqa: E402  (benchmarks/traces.py, beside this script)

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=1024)  # fmt: skip
CLASSES = ("high", "low")
SPLIT, ONE = ("stream", "whole"), ("stream_1p", "whole_1p")  # the server's modes by its kind


def make_checkpoint(path: Path, smoke: bool) -> Path:
    """A random-weight Llama and a word-level tokenizer (w0 .. w{V-1}, no special token, so
    every token is text and no EOS ends a request early), saved to `path`."""
    import torch
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shape = TINY if smoke else LLAMA_1B
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**shape, max_position_embeddings=4096))
    model = model.to(torch.float32 if smoke else torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    words = {f"w{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    T.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


# --- the client side ------------------------------------------------------------------------


def send(url: str, model: str, req: dict, stream: bool, start: float) -> dict:
    """One request at its arrival time; its timings."""
    time.sleep(max(0.0, start + req["at"] - time.monotonic()))
    host, port = url.removeprefix("http://").split(":")
    body = {"model": model, "prompt": req["prompt_ids"], "max_tokens": req["max_tokens"],
            "min_tokens": req["max_tokens"], "temperature": 0, "priority": req["priority"],
            "stream": stream, "return_token_ids": True}  # fmt: skip
    t0 = time.monotonic()
    out = dict(priority=req["priority"], ok=False)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return dict(out, error=f"{resp.status}: {resp.read()[:200]!r}")
        if not stream:
            got = json.loads(resp.read())
            tokens = len(got["choices"][0]["token_ids"])
            return dict(out, ok=True, tokens=tokens, done=time.monotonic() - t0)
        times, tokens = [], 0
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                if c.get("text"):
                    times.append(time.monotonic())
                tokens = len(c.get("token_ids", ())) or tokens
        done = time.monotonic() - t0
        tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None
        ttft = times[0] - t0 if times else None
        return dict(out, ok=True, tokens=tokens, ttft=ttft, tpot=tpot, done=done)
    except Exception as err:  # noqa: BLE001 - counted as failed
        return dict(out, error=repr(err))


def run_trace(reqs: list[dict], one) -> tuple[list[dict], float]:
    results: list[dict] = [{}] * len(reqs)
    start = time.monotonic()

    def work(i):
        results[i] = one(reqs[i], start)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - start


def with_cpu(out: dict, cpu_s: float, engine_s: float | None = None) -> dict:
    """The serving processes' CPU time (every thread: the engine's, the requests', the event
    loop's) per generated token, µs: what the host spends beside the GPU's work. In-process it
    includes the trace's own client threads. `engine_s`: the engine process's part."""
    tokens = out["tok_per_s"] * out["seconds"]
    if tokens > 0 and cpu_s == cpu_s:
        out["cpu_us_per_token"] = round(1e6 * cpu_s / tokens, 1)
        if engine_s:
            out["engine_cpu_us_per_token"] = round(1e6 * engine_s / tokens, 1)
    return out


def summarize(mode: str, rate: float, results: list[dict], took: float) -> dict:
    ok = [r for r in results if r.get("ok")]
    out = dict(
        mode=mode,
        rate=rate,
        requests=len(results),
        ok=len(ok),
        tok_per_s=round(sum(r["tokens"] for r in ok) / took, 1),
        seconds=round(took, 2),
    )
    errors = [r["error"] for r in results if not r.get("ok")]
    if errors:
        out["first_error"] = errors[0][:300]
    for cls in CLASSES:
        rs = [r for r in ok if r["priority"] == cls]
        if rs:
            ms = lambda xs, q: round(pct(xs, q) * 1000, 2)  # noqa: E731
            ttft, tpot = [r.get("ttft") for r in rs], [r.get("tpot") for r in rs]
            out[cls] = dict(
                n=len(rs),
                ttft_p50_ms=ms(ttft, 0.5),
                ttft_p99_ms=ms(ttft, 0.99),
                tpot_p50_ms=ms(tpot, 0.5),
                tpot_p99_ms=ms(tpot, 0.99),
                mean_done_s=round(statistics.fmean(r["done"] for r in rs), 3),
            )
    return out


# --- the server side and in-process --------------------------------------------------------


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, every thread; NaN where /proc is missing."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The process's child processes (Linux: /proc)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def child_env() -> dict:
    """This environment with the repository first on PYTHONPATH (what was there kept after it)."""
    path = [str(HERE.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


class ServerProcess:
    """`python -m oxygen_torch serve` on a free loopback port, until close()."""

    def __init__(self, ckpt: Path, args, one_process: bool = False):
        cmd = [sys.executable, "-m", "oxygen_torch", "serve", str(ckpt), "--port", "0",
               "--model-name", "bench", "--log-level", "warning", "--max-queue", "100000",
               "--conf", args.conf] + (["--one-process"] if one_process else [])  # fmt: skip
        env = child_env()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)  # fmt: skip
        lines, deadline = [], time.monotonic() + 1800
        self.url = None
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the server did not start:\n" + "".join(lines[-40:]))
            lines.append(line)
            if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
                self.url = m.group(1)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain its output

    def cpu_s(self) -> tuple[float, float]:
        """CPU time so far of the server and its engine process, every thread, and of the
        engine process alone (Linux: /proc)."""
        engine = sum(process_cpu_s(c) for c in children(self.proc.pid))
        return process_cpu_s(self.proc.pid) + engine, engine

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def inprocess(ckpt: Path, reqs: list[dict], warm: list[dict], conf: str,
              warm_trace: bool = False) -> tuple:  # fmt: skip
    """The trace as generate() threads in this process, the engine on (as `serve` sets it):
    (results, seconds, this process's CPU seconds in the timed run)."""
    import torch

    from oxygen_torch.tools.serve.loading import configure_oxygen, load, warm_up
    from oxygen_torch.tools.serve.served import Served

    configure_oxygen(conf)
    model, tokenizer = load(str(ckpt))
    # the server's own warm-up first (1 row, then 2: the decode graphs compile, their sizes
    # symbolic), then the trace's: without it the first in-process run compiled in its timed
    # part (H200, rate 16: TTFT P50 2.1 s against the server's 89 ms)
    warm_up(model, Served.of(model, tokenizer).pad)

    def one(req: dict, start: float) -> dict:
        import oxygen_torch

        time.sleep(max(0.0, start + req["at"] - time.monotonic()))
        x = torch.tensor([req["prompt_ids"]], device=model.device)
        clock, t0, n = Clock(), time.monotonic(), req["max_tokens"]
        with oxygen_torch.task(priority=req["priority"]), torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, streamer=clock)  # fmt: skip
        t = clock.times
        tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
        return dict(priority=req["priority"], ok=True, tokens=len(t), ttft=t[0] - t0,
                    tpot=tpot, done=time.monotonic() - t0)  # fmt: skip

    run_trace(warm, one)
    if warm_trace:  # the trace once untimed: its decode graphs' rows buckets and widths
        run_trace(reqs, one)
    cpu = process_cpu_s()
    results, took = run_trace(reqs, one)
    return results, took, process_cpu_s() - cpu


def requests(args, rate: float) -> tuple[list[dict], list[dict]]:
    vocab = (TINY if args.smoke else LLAMA_1B)["vocab_size"]
    cap_p, cap_n = (48, 16) if args.smoke else (2048, 1024)
    reqs = trace(args.seed, args.requests, rate, args.cv, 0.2, vocab, cap_p, cap_n)
    # warm-up: the trace's first requests, all at once, short (compiles, graph captures)
    warm = [dict(r, at=0.0, max_tokens=min(8, r["max_tokens"])) for r in reqs[: args.warm]]
    return reqs, warm


def run_server_modes(ckpt: Path, args, rate: float, modes: list[str],
                     one_process: bool = False) -> list[dict]:  # fmt: skip
    """One server for the rate, warmed up once; the modes one after the other against it."""
    out = []
    reqs, warm = requests(args, rate)
    if not modes:
        return out
    server = ServerProcess(ckpt, args, one_process)
    try:
        run_trace(warm, lambda r, s: send(server.url, "bench", r, True, s))
        if args.warm_trace:  # the trace once untimed: the first timed mode captured the decode
            # graphs of the trace's rows buckets and widths, and the second ran on them (H200,
            # rate 64: streamed 0.77x not streamed, the streamed run first)
            run_trace(reqs, lambda r, s: send(server.url, "bench", r, False, s))
        for mode in modes:
            stream = mode.startswith("stream")
            cpu, engine = server.cpu_s()
            results, took = run_trace(
                reqs, lambda r, s, stream=stream: send(server.url, "bench", r, stream, s)
            )
            cpu_after, engine_after = server.cpu_s()
            out.append(with_cpu(summarize(mode, rate, results, took), cpu_after - cpu,
                                engine_after - engine))  # fmt: skip
    finally:
        server.close()
    return out


def run_inprocess(ckpt: Path, args, rate: float) -> dict:
    """In its own process (the engine and the pool are the process's)."""
    cmd = (
        [
            sys.executable,
            __file__,
            "--run-inprocess",
            str(ckpt),
            "--rates",
            str(rate),
            "--requests",
            str(args.requests),
            "--seed",
            str(args.seed),
            "--cv",
            str(args.cv),
            "--warm",
            str(args.warm),
            "--conf",
            args.conf,
        ]
        + (["--smoke"] if args.smoke else [])
        + ([] if args.warm_trace else ["--no-warm-trace"])
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200,
                          env=child_env())  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        return dict(mode="inprocess", rate=rate, error=(proc.stdout + proc.stderr)[-2000:])
    return json.loads(lines[-1])


def show(r: dict) -> None:
    if "error" in r:
        print(f"{r['mode']:9} rate {r['rate']:6.2f}: FAILED {r['error'][-500:]}")
        return
    head = (f"{r['mode']:9} rate {r['rate']:6.2f}: {r['ok']}/{r['requests']} ok, "
            f"{r['tok_per_s']:9.1f} tok/s")  # fmt: skip
    parts = []
    for cls in CLASSES:
        c = r.get(cls)
        if c:
            timed = (
                ""
                if r["mode"].startswith("whole")
                # a whole answer has no token times
                else (
                    f" TTFT P50/P99 {c['ttft_p50_ms']}/{c['ttft_p99_ms']} ms, TPOT "
                    f"{c['tpot_p50_ms']}/{c['tpot_p99_ms']} ms,"
                )
            )
            parts.append(f"{cls}{timed} request mean {c['mean_done_s']} s")
    cpu = f" | host CPU {r['cpu_us_per_token']} µs/token" if "cpu_us_per_token" in r else ""
    if "engine_cpu_us_per_token" in r:
        cpu += f" (engine process {r['engine_cpu_us_per_token']})"
    print(
        head + " | " + " | ".join(parts) + cpu
        + (f" | {r['first_error']}" if "first_error" in r else "")
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, few requests")
    p.add_argument("--checkpoint", help="a local checkpoint (default: a random one, written)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="arrivals per second")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", type=int, default=4, help="warm-up requests before each mode")
    p.add_argument("--modes", nargs="+", default=["stream", "whole", "inprocess"],
                   choices=["stream", "whole", "stream_1p", "whole_1p", "inprocess"])  # fmt: skip
    p.add_argument("--ttft-limit", type=float, default=1.0, help="s: stop rising past this P99")
    p.add_argument(
        "--conf", default="", help="oxygen configuration for both sides (OXYGEN_CONF form)"
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--no-warm-trace", dest="warm_trace", action="store_false",
        help="skip the untimed run of the trace before the timed modes (each server's, and the "
        "in-process one's: the decode graphs its rows and lengths need captured beforehand)",
    )  # fmt: skip
    p.add_argument("--run-inprocess", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rates = args.rates or ([4.0, 8.0] if args.smoke else [2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    args.requests = args.requests or (12 if args.smoke else 200)
    if args.run_inprocess:
        reqs, warm = requests(args, args.rates[0])
        results, took, cpu = inprocess(Path(args.run_inprocess), reqs, warm, args.conf,
                                       args.warm_trace)  # fmt: skip
        out = with_cpu(summarize("inprocess", args.rates[0], results, took), cpu)
        print(json.dumps(out), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else make_checkpoint(Path(tmp), args.smoke)
        everything = []
        for rate in args.rates:
            rows = run_server_modes(ckpt, args, rate, [m for m in args.modes if m in SPLIT])
            rows += run_server_modes(ckpt, args, rate, [m for m in args.modes if m in ONE], True)
            if "inprocess" in args.modes:
                rows.append(run_inprocess(ckpt, args, rate))
            for r in rows:
                show(r)
            everything += rows
            stream = next((r for r in rows if r["mode"] == "stream" and "error" not in r), None)
            worst = (
                max((stream.get(c, {}).get("ttft_p99_ms", 0) for c in CLASSES), default=0)
                if stream
                else 0
            )
            if worst > args.ttft_limit * 1000:
                print(f"stream TTFT P99 {worst:.0f} ms > {args.ttft_limit:g} s: stop rising")
                break
        if args.json:
            Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
