"""The oxygen backend end to end with Inductor on CPU (C++ codegen): a tiny random HF Llama with
SDPA attention and a padding mask, a hand-written block, and decode steps with dynamic shapes.
These are the slow ones (Inductor's C++ build: ~10-40 s per graph on a CI CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import oxygen_torch.compile as oc

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile")]


def tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def test_tiny_llama_every_attention_rewritten():
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: a real mask reaches SDPA
    compiled = torch.compile(model, backend="oxygen", fullgraph=True)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        out = compiled(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0, 3:], ref[0, 3:], atol=1e-4, rtol=1e-4)  # non-pad rows
    s = oc.stats()
    assert s["graphs_compiled"] == 1
    assert s["attention_found"] == 2 and s["rewritten"] == 2 and s["left"] == 0, s


class Block(torch.nn.Module):
    """A hand-written attention and an SDPA call in one graph, with projections around them."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        w = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5 + mask, dim=-1)
        return (w @ v) + F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_block_with_inductor():
    torch.manual_seed(0)
    block = Block().eval()
    x, mask = torch.randn(2, 6, 32), torch.randn(6, 6)
    with torch.no_grad():
        out = torch.compile(block, backend="oxygen", fullgraph=True)(x, mask)
        torch.testing.assert_close(out, block(x, mask), atol=1e-5, rtol=1e-5)
    s = oc.stats()
    assert s["rewritten"] == 2 and s["left"] == 0, s


def test_dynamic_decode_with_inductor():
    """64 decode steps at growing lengths compile at most twice (static, then dynamic)."""

    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    fn = torch.compile(step, backend="oxygen", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 66, 16, generator=g)
    for n in range(2, 66):
        k, v = kv[:, :, :n].contiguous(), kv[:, :, :n] * 0.5
        out = fn(q, k, v)
        if n in (2, 40, 65):
            torch.testing.assert_close(out, step(q, k, v), atol=1e-5, rtol=1e-5)
    s = oc.stats()
    assert s["graphs_compiled"] <= 2 and s["rewritten"] == s["graphs_compiled"], s
