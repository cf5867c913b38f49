"""benchmarks/bench_multitask.py gil_holders: py-spy's raw samples of the interpreter lock's
holder sorted by kind of thread (the engine's, the callers', the main one, others by name), and
the callers' most sampled frames (oxygen_torch's innermost three when any)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_multitask import gil_holders  # noqa: E402

OURS = [
    ["x/oxygen_torch/integrations/hf/front.py:{}:run", "x/oxygen_torch/engine/request.py:{}:wait"],
    ["x/oxygen_torch/integrations/hf/front.py:{}:plan", "x/oxygen_torch/engine/door.py:{}:caller"],
]


def _frame(spec: str, line: int) -> str:
    path, _, name = spec.format(line).rpartition(":")
    return f"{name} ({path})"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_samples_are_shared_by_kind_and_the_callers_frames_counted(seed):
    rng = random.Random(seed)
    want = {"engine": 0, "caller": 0, "main": 0, "oxygen-kv-ahead": 0, "pt_autograd": 0}
    frames: dict[str, int] = {}
    lines = []
    for _ in range(rng.randint(20, 60)):
        n = rng.randint(1, 50)
        kind = rng.choice(["engine", "caller", "caller", "main", "pt_autograd", "oxygen-kv-ahead"])
        tid = rng.randint(100, 999)
        base = ["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)"]
        if kind == "engine":
            name = rng.choice(["oxygen-LlamaForCausalLM", "oxygen-Qwen3ForCausalLM"])
            calls = base + ["_loop (x/oxygen_torch/engine/loop.py:260)"]
        elif kind == "caller":
            name = f"Thread-{rng.randint(1, 600)} (work)"
            calls = base + ["one (bench_multitask.py:154)"]
            if rng.random() < 0.8:  # in oxygen_torch: its innermost frames (up to 3), inner first
                spec = rng.choice(OURS)
                calls += [_frame(s, rng.randint(1, 9)) for s in spec]
                calls += ["Condition.wait (threading.py:327)"]
                key = " < ".join([spec[1].rsplit(":", 1)[1], spec[0].rsplit(":", 1)[1]])
            else:  # none of it: the innermost three frames of any kind
                key = "one < Thread.run < Thread._bootstrap"
            frames[key] = frames.get(key, 0) + n
        elif kind == "main":
            name = "MainThread"
            calls = ["<module> (bench_multitask.py:900)"]
        else:  # a thread of no caller: oxygen_torch's own helper, or another, by its name
            name = kind
            calls = base
        want[kind] += n
        lines.append(f"thread ({tid}): {name};{';'.join(calls)} {n}")
    lines += ["", "not a sample line"]
    got = gil_holders(lines, top=50)
    total = sum(want.values())
    assert got["samples"] == total
    assert got["share"] == {k: round(v / total, 3) for k, v in want.items() if v}
    assert list(got["share"].values()) == sorted(got["share"].values(), reverse=True)
    assert dict(got["callers_top"]) == frames
