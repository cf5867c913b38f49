"""Load for examples/serve.py: requests arriving in bursts, two priority classes, chat-like lengths.

    python examples/serve.py &                         # then:
    python examples/load.py --requests 64 --rate 8 --cv 4 --high 0.2 --seed 1

Arrivals are gamma-distributed (coefficient of variation --cv: 1 is Poisson, 4 is bursty), a
share --high of the requests is high priority, prompt and output lengths are log-normal like chat
traffic (means about 160 and 340 tokens, capped by --max-prompt / --max-new). Each request is sent
from its own thread at its arrival time; the summary gives, per class, completed and failed
requests and the P50 / P99 of time to first token and of the whole request.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
import urllib.request


def trace(seed: int, n: int, rate: float, cv: float, high: float, vocab: int,
          max_prompt: int, max_new: int) -> list[dict]:  # fmt: skip
    """n requests: arrival time (s), priority, prompt ids, max_tokens; the same for a seed."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)  # gamma: mean 1/rate, coefficient of variation cv
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        p = min(max_prompt, max(1, int(rng.lognormvariate(math.log(160) - 0.5, 1.0))))
        new = min(max_new, max(1, int(rng.lognormvariate(math.log(340) - 0.5, 1.0))))
        prio = "high" if rng.random() < high else "low"
        ids = [rng.randrange(1, vocab) for _ in range(p)]
        out.append(dict(at=t, priority=prio, prompt_ids=ids, max_tokens=new))
    return out


def send(url: str, req: dict, results: list, start: float) -> None:
    time.sleep(max(0.0, start + req["at"] - time.monotonic()))
    body = json.dumps({k: req[k] for k in ("prompt_ids", "max_tokens", "priority")}).encode()
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=600) as r:
            got = json.loads(r.read())
        wall = (time.monotonic() - t0) * 1000
        results.append(
            dict(req, ok=True, ttft=got.get("ttft_ms"), total=got["total_ms"], wall=wall,
                 tokens=len(got["ids"]))
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - counted as failed
        results.append(dict(req, ok=False, error=repr(err)))


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1/completions")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second")
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--high", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-new", type=int, default=1024)
    a = p.parse_args()
    reqs = trace(a.seed, a.requests, a.rate, a.cv, a.high, a.vocab, a.max_prompt, a.max_new)
    results: list[dict] = []
    start = time.monotonic()
    threads = [threading.Thread(target=send, args=(a.url, r, results, start)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    tokens = sum(r.get("tokens", 0) for r in results)
    print(f"{len(results)} requests in {took:.1f} s, {tokens / took:.1f} generated tok/s")
    for prio in ("high", "low"):
        rs = [r for r in results if r["priority"] == prio]
        ok = [r for r in rs if r["ok"]]
        ttft, wall = [r["ttft"] for r in ok], [r["wall"] for r in ok]
        print(
            f"{prio:5}: {len(ok)}/{len(rs)} ok, TTFT P50 {pct(ttft, 0.5):.0f} P99 "
            f"{pct(ttft, 0.99):.0f} ms, request P50 {pct(wall, 0.5):.0f} P99 "
            f"{pct(wall, 0.99):.0f} ms"
        )


if __name__ == "__main__":
    main()
