"""Metrics and leak check while a real generate() runs (the issue-7 check on the H200).

    python benchmarks/metrics_smoke.py                 # Llama-1.1B shape, random weights, bf16
    python benchmarks/metrics_smoke.py --new 32        # shorter
    python benchmarks/metrics_smoke.py --device cpu    # tiny model, host pool (CI-sized)

Starts the metrics endpoint on loopback, runs generate() under oxygen_torch.enable() in a thread,
scrapes /metrics from the main thread while it runs, prints the key values of the scrape with
the most memory allocated, then drops the model, disable()s, and runs the leak check. Exit code 1
if the mid-run scrape shows nothing allocated (on CUDA) or the leak check finds a leak.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

import oxygen_torch
from oxygen_torch.tools import cli_stats, leakcheck, metrics

MiB = 1 << 20
KEYS = [
    "oxygen:pool_allocated_bytes",
    "oxygen:pool_mapped_bytes",
    "oxygen:pool_reserved_va_bytes",
    "oxygen:pool_fragmentation_ratio",
    "oxygen:pool_maps_total",
    "oxygen:pool_unmaps_total",
    "oxygen:pool_map_latency_seconds_count",
    "oxygen:pool_map_latency_seconds_sum",
    "oxygen:pool_oom_total",
    "oxygen:kv_blocks",
    "oxygen:kv_cache_usage_perc",
]


def build(device: str):
    from oxygen_torch.tools.demo_models import LLAMA_1B, TINY_LLAMA, random_llama

    big = device == "cuda"
    return random_llama(
        LLAMA_1B if big else TINY_LLAMA,
        dtype=torch.bfloat16 if big else torch.float32,
        device=device,
        max_position_embeddings=4096,
    )


def scrape(url: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "backend"))
            out[(s.name, labels)] = s.value
    return out


def allocated(sample: dict) -> float:
    return sum(v for (n, _), v in sample.items() if n == "oxygen:pool_allocated_bytes")


def generate_while_scraping(model, ids, new_tokens: int, url: str) -> tuple[dict, list, float]:
    """generate() in a thread; scrapes every 0.25 s. Returns (the scrape with the most
    allocated, scrape times in ms, generate seconds)."""
    done = threading.Event()
    seconds = []

    def run():
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    best, scrape_ms = {}, []
    while not done.wait(0.25):
        t = time.perf_counter()
        sample = scrape(url)
        scrape_ms.append((time.perf_counter() - t) * 1e3)
        if allocated(sample) >= allocated(best):
            best = sample
    worker.join()
    return best, scrape_ms, seconds[0] if seconds else float("nan")


def report_leaks(device: str) -> bool:
    # A fresh pool's life cycle, then the whole process expecting everything released.
    rep = leakcheck.run(("cuda",) if device == "cuda" else ("host",))
    for line in rep.checked:
        print(f"leak check: checked: {line}")
    for line in rep.skipped:
        print(f"leak check: skipped: {line}")
    for line in rep.leaks:
        print(f"leak check: LEAK: {line}")
    print("leak check:", "OK" if rep.ok else "LEAKS FOUND")
    return rep.ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    oxygen_torch.enable()
    server = metrics.start_http_server(port=0)  # loopback, a free port
    url = f"http://127.0.0.1:{server.socket.getsockname()[1]}/metrics"
    print(f"metrics endpoint: {url} (bound to {server.socket.getsockname()[0]})")
    model = build(args.device)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), device=args.device)
    best, scrape_ms, seconds = generate_while_scraping(model, ids, args.new, url)
    print(
        f"generate: {args.batch * args.new} tokens in {seconds:.2f} s; {len(scrape_ms)} scrapes "
        f"mid-run, the slowest {max(scrape_ms, default=0):.1f} ms"
    )
    print("mid-run scrape with the most allocated:")
    for (name, labels), v in sorted(best.items()):
        if name in KEYS:
            shown = f"{v / MiB:,.1f} MiB" if name.endswith("bytes") else f"{v:,.4g}"
            print(f"  {name}{dict(labels)} = {shown}")
    print(cli_stats.render(url))
    ok = bool(scrape_ms) and (args.device != "cuda" or allocated(best) > 0)
    if not ok:
        print("FAIL: no mid-run scrape, or none showed memory allocated in the pool")
    del model, ids
    gc.collect()
    oxygen_torch.disable()
    ok = report_leaks(args.device) and ok
    metrics.stop_http_servers()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
