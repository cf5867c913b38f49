"""benchmarks/multitask_at_once.py parts_table: the profile of a step sorted into its parts
(attention, matmuls, logits and sampling, ...) from kernel names, with the share of the wall
time no kernel ran."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from multitask_at_once import parts_table  # noqa: E402

NAMES = {
    "attention": ["_decode_kernel", "_prefill_kernel", "_combine_kernel"],
    "matmuls": ["sm90_xmma_gemm_bf16bf16_bf16f32", "nvjet_tst_128x64", "cutlass_80_tensorop"],
    "logits, sampling": ["_sample_kernel", "at::native::argmax_kernel", "index_put_kernel"],
    "kv writes": ["_append_kernel"],
    "copies": ["Memcpy HtoD (Pinned -> Device)"],
    "fused elementwise (norms, rotary, activations)": [
        "triton_red_fused_add_mean_mul_pow_0",
        "triton_poi_fused__to_copy__unsafe_view_add_bmm_cat_cos_mul_1",
    ],
    "other": ["void at::native::vectorized_elementwise_kernel"],
}


def _kernel(name: str, us: float):
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, device_time_total=us,
                           cpu_time=0.0, cpu_children=[])  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_are_summed_by_part_with_shares_and_the_idle_wall(seed):
    rng = random.Random(seed)
    events, want = [], {}
    for part, names in NAMES.items():
        for _ in range(rng.randint(1, 6)):
            us = rng.uniform(1, 500)
            events.append(_kernel(rng.choice(names), us))
            want[part] = want.get(part, 0.0) + us
    events.append(
        SimpleNamespace(
            name="aten::mm",
            device_type=DeviceType.CPU,
            device_time_total=0.0,
            cpu_time=1e6,
            cpu_children=[],
        )
    )  # (a CPU op: not counted)
    events.append(_kernel("Event Sync", 1e6))  # (the profiler's event waits: no kernel)
    rng.shuffle(events)
    whole = sum(want.values())
    wall = 4 * whole / 1e6
    text = parts_table(events, wall)
    rows = {r.split(" | ")[0].lstrip("| "): r for r in text.splitlines() if r.startswith("| ")}
    for part, us in want.items():
        cells = rows[part].strip("| ").split(" | ")
        assert float(cells[1]) == pytest.approx(us / 1e3, abs=0.051)
        assert float(cells[2].rstrip(" %")) == pytest.approx(100 * us / whole, abs=0.051)
    assert f"{whole / 1e3:.1f} ms in all" in text
    assert "no kernel ran 75.0 %" in text


@pytest.mark.parametrize("tied, seed", [(False, 0), (True, 1), (False, 2)])
def test_the_read_floor_counts_every_weight_but_the_lookup_table_and_each_rows_kv(tied, seed):
    """read_floor: the weights a decode step reads (the input embedding only when it is the
    output head too, and a tied table once) plus each row's K and V at its mean length, over a
    copy bandwidth measured in the process."""
    import transformers as T
    from multitask_at_once import read_floor

    rng = random.Random(seed)
    heads, kv_heads, layers = 4, rng.choice([1, 2, 4]), rng.randint(1, 3)
    cfg = T.LlamaConfig(hidden_size=64, intermediate_size=rng.choice([96, 128]),
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, vocab_size=rng.randint(200, 600),
                        tie_word_embeddings=tied)  # fmt: skip
    model = T.LlamaForCausalLM(cfg).eval()
    reqs = [([1] * rng.randint(3, 40), rng.randint(1, 20)) for _ in range(rng.randint(1, 6))]
    got = read_floor(model, reqs, "cpu", copy_bytes=4 << 20)
    table = 4 * cfg.vocab_size * cfg.hidden_size  # float32
    every = 4 * sum(p.numel() for p in model.parameters())  # (a tied table listed once)
    assert got["weight_bytes"] == every + sum(b.nbytes for b in model.buffers()) - (
        0 if tied else table
    )
    head_dim = cfg.hidden_size // heads
    tokens = sum(len(p) + n / 2 for p, n in reqs)
    assert got["kv_bytes"] == int(tokens * 2 * layers * kv_heads * head_dim * 4)
    bw = got["copy_bytes_per_s"]
    assert bw > 0
    want = 1e3 * (got["weight_bytes"] + got["kv_bytes"]) / bw
    assert got["floor_ms"] == pytest.approx(want, rel=1e-6, abs=1e-3)
