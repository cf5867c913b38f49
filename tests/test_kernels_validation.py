"""Bad inputs raise ValueError naming the argument; CPU tensors without the interpreter point at
the float64 references."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import kv_append, paged_decode, paged_prefill
from test_kernels_helpers import make_paged, randn


def _decode_args():
    p = make_paged([20, 9], 2, 64, 16, torch.float16)
    q = randn((2, 4, 64), torch.float16, seed=1)
    return dict(
        q=q, k_cache=p.k_cache, v_cache=p.v_cache, block_table=p.block_table, seq_lens=p.seq_lens
    )


def _prefill_args():
    args = _decode_args()
    args["q"] = randn((7, 4, 64), torch.float16, seed=2)
    args["cu_seqlens_q"] = torch.tensor([0, 4, 7], dtype=torch.int32)
    return args


def _append_args():
    p = make_paged([20], 2, 64, 16, torch.float16)
    k = randn((3, 2, 64), torch.float16, seed=3)
    return dict(
        k=k,
        v=k.clone(),
        k_cache=p.k_cache,
        v_cache=p.v_cache,
        slot_mapping=torch.tensor([0, 1, -1], dtype=torch.int32),
    )


def _fp8_cache(args):
    args["k_cache"] = torch.zeros(args["k_cache"].shape, dtype=torch.uint8)
    args["v_cache"] = torch.zeros(args["v_cache"].shape, dtype=torch.uint8)


BAD = [
    ("q", lambda a: a.update(q=a["q"].float()), "k_cache"),  # dtype mismatch with the cache
    ("q", lambda a: a.update(q=a["q"][..., :32]), "q"),
    ("q", lambda a: a.update(q=a["q"][:, :3]), "q"),  # 3 q heads over 2 kv heads
    ("q", lambda a: a.update(q=a["q"].to(torch.int32)), "q"),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][:, :, :, :32]), "k_cache"),
    (
        "k_cache",
        lambda a: a.update(k_cache=a["k_cache"][:, :12], v_cache=a["v_cache"][:, :12]),
        "block_tokens",
    ),
    ("v_cache", lambda a: a.update(v_cache=a["v_cache"].float()), "v_cache"),
    ("v_cache", lambda a: a.update(v_cache=a["v_cache"][:-1]), "v_cache"),
    ("block_table", lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    ("block_table", lambda a: a.update(block_table=a["block_table"][:1]), "block_table"),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
    ("scale", lambda a: a.update(scale=-1.0), "scale"),
    ("sliding_window", lambda a: a.update(sliding_window=0), "sliding_window"),
    ("sliding_window", lambda a: a.update(sliding_window=2.5), "sliding_window"),
    ("precision", lambda a: a.update(precision="fastest"), "precision"),
    ("out", lambda a: a.update(out=torch.empty(3, 4, 64, dtype=torch.float16)), "out"),
    ("out", lambda a: a.update(out=torch.empty_like(a["q"]).float()), "out"),
    ("k_scale", lambda a: a.update(k_scale=torch.ones(40, 2)), "k_scale"),  # not fp8
    ("k_scale", _fp8_cache, "k_scale"),  # fp8 without scales
]


@pytest.mark.parametrize("what,mutate,name", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_attention_bad_inputs_name_the_argument(kernel, what, mutate, name):
    args = _decode_args() if kernel == "decode" else _prefill_args()
    fn = paged_decode if kernel == "decode" else paged_prefill
    mutate(args)
    with pytest.raises(ValueError, match=name):
        fn(**args)


@pytest.mark.parametrize(
    "mutate,name",
    [(lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q"),
     (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]), "block_table"),  # batch 1 vs 2
     (lambda a: a.update(causal=1), "causal")],
)  # fmt: skip
def test_prefill_bad_inputs(mutate, name):
    args = _prefill_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        paged_prefill(**args)


@pytest.mark.parametrize(
    "mutate,name",
    [(lambda a: a.update(k=a["k"][:, :1]), "k"),
     (lambda a: a.update(v=a["v"][:2]), "v"),
     (lambda a: a.update(k=a["k"].float()), "k"),
     (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping"),
     (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "slot_mapping"),
     (lambda a: a.update(k_scale=torch.ones(4, 2)), "k_scale"),
     (_fp8_cache, "k_scale"),
     (lambda a: (_fp8_cache(a), a.update(k_scale=torch.ones(5, 2), v_scale=torch.ones(3, 2))),
      "v_scale")],
)  # fmt: skip
def test_append_bad_inputs(mutate, name):
    args = _append_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        kv_append(**args)


@pytest.mark.parametrize("kernel", ["decode", "prefill", "append"])
def test_cpu_without_interpreter_points_at_reference(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = {"decode": _decode_args, "prefill": _prefill_args, "append": _append_args}[kernel]()
    fn = {"decode": paged_decode, "prefill": paged_prefill, "append": kv_append}[kernel]
    with pytest.raises(ValueError, match="oxygen_torch.triton_kernels.reference"):
        fn(**args)
