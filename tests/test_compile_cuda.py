"""The oxygen ops and backend on the GPU (skipped on CPU machines): the Triton dense kernel behind
oxygen::attention in bf16/fp16, compiled models through Inductor (which inlines the triton_op's
kernel), mode="reduce-overhead" with the backend's own CUDA graphs, a paged decode step captured
and replayed in a CUDA graph, and transformers' static-cache generate through the backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oxygen_torch.triton_kernels.reference import paged_decode_ref

import oxygen_torch.compile as oc
from oxygen_torch.kv.attention import kv_write as kv_append
from oxygen_torch.kv.attention import paged_attention

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_compile")]
ops = torch.ops.oxygen
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
DTYPES = [torch.bfloat16, torch.float16]


def _randn(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _sdpa64(q, k, v, mask=None, causal=False, scale=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(
        q.double(), k, v, attn_mask=mask, is_causal=causal, scale=scale
    )


SHAPES = [
    # (b, hq, hkv, sq, sk, d, causal, mask)
    (2, 32, 8, 128, 128, 64, True, None),
    (4, 32, 8, 1, 768, 64, False, "bool"),  # a static-cache decode step
    (2, 16, 2, 100, 300, 128, True, None),  # causal, Sq < Sk: SDPA's top-left alignment
    (1, 8, 8, 64, 64, 256, False, "add"),
    (3, 12, 4, 33, 77, 80, False, "bool"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kind", SHAPES)
def test_attention_op_cuda(b, hq, hkv, sq, sk, d, causal, kind, dtype):
    q, k, v = (
        _randn((b, hq, sq, d), dtype, 1),
        _randn((b, hkv, sk, d), dtype, 2),
        _randn((b, hkv, sk, d), dtype, 3),
    )
    mask = None
    if kind == "bool":
        mask = _randn((b, 1, sq, sk), torch.float32, 4) > -0.5
        mask[..., 0] = True
    elif kind == "add":
        mask = _randn((sq, sk), dtype, 4)
    out = ops.attention(q, k, v, mask, causal, None)
    ref = _sdpa64(q, k, v, mask, causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(256, 3 * 256)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 64).permute(2, 0, 3, 1, 4)
        hand = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v
        return hand + F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_block_cuda(dtype, mode):
    torch.manual_seed(0)
    block = Block().cuda().to(dtype).eval()
    fn = torch.compile(block, backend="oxygen", mode=mode, fullgraph=True)
    with torch.no_grad():
        for seed in range(4):  # warm-up, capture, replays with fresh inputs
            x = _randn((2, 64, 256), dtype, seed)
            torch.testing.assert_close(fn(x), block(x), atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)
    s = oc.stats()
    assert s["rewritten"] == 2 and s["left"] == 0, s
    if mode == "reduce-overhead":
        assert s["cuda_graphs"].get("captured") == 1 and s["cuda_graphs"].get("replayed") == 3, s


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).cuda().to(dtype).eval()


def test_tiny_llama_cuda_bf16():
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits.float()
        out = torch.compile(model, backend="oxygen", fullgraph=True)(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits.float()[1], ref[1], atol=5e-2, rtol=5e-2)
    s = oc.stats()
    assert s["rewritten"] == 2 and s["left"] == 0, s


def test_hf_static_generate_reduce_overhead_cuda():
    """transformers' compiled static-cache decode through the backend, with its CUDA graphs:
    greedy tokens equal uncompiled generate (fp32 model: no ties broken differently)."""
    from transformers import CompileConfig

    model = _tiny_llama(torch.float32)
    ids = torch.randint(1, 512, (4, 16), device="cuda")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        config = CompileConfig(backend="oxygen", mode="reduce-overhead", fullgraph=True)
        out = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
        again = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    s = oc.stats()
    assert s["left"] == 0 and s["rewritten"] >= 2, s
    assert s["cuda_graphs"].get("replayed", 0) >= 10, s


def _paged_setup(b=4, hq=32, hkv=8, d=64, bt=16, max_len=256, dtype=torch.bfloat16):
    nblocks = b * max_len // bt
    k_cache = torch.zeros(nblocks, bt, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(nblocks, device="cuda").to(torch.int32).view(b, -1)
    return k_cache, v_cache, table


def _decode_step(q, k, v, k_cache, v_cache, table, seq_lens, slots):
    kv_append(k, v, k_cache, v_cache, slots)
    return paged_attention(q, k_cache, v_cache, table, seq_lens)


def _slots(table, pos, bt=16):
    """slot of each sequence's token at position pos ([B] int64, on device, no host sync)."""
    blk = table.gather(1, (pos // bt).view(-1, 1).long()).view(-1).long()
    return blk * bt + pos % bt


def test_paged_decode_step_in_a_cuda_graph():
    """kv_append + paged_attention captured once, replayed at growing lengths with the inputs
    updated in place (block table and lengths live on the GPU: no host sync in the step)."""
    b, hq, hkv, d = 4, 32, 8, 64
    k_cache, v_cache, table = _paged_setup(b, hq, hkv, d)
    start = torch.tensor([5, 40, 17, 100], device="cuda", dtype=torch.int32)
    for i in range(b):  # a prefix per sequence
        n = int(start[i])
        pos = torch.arange(n, device="cuda")
        slots = table[i, pos // 16].long() * 16 + pos % 16
        kv_append(
            _randn((n, hkv, d), torch.bfloat16, 10 + i),
            _randn((n, hkv, d), torch.bfloat16, 20 + i),
            k_cache,
            v_cache,
            slots,
        )
    q, k, v = (torch.zeros(b, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    seq_lens, slots = start + 1, _slots(table, start.long())
    _decode_step(q, k, v, k_cache.clone(), v_cache.clone(), table, seq_lens, slots)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(q, k, v, k_cache, v_cache, table, seq_lens, slots)
    for step in range(5):
        q.copy_(_randn((b, hq, d), torch.bfloat16, 100 + step))
        k.copy_(_randn((b, hkv, d), torch.bfloat16, 200 + step))
        v.copy_(_randn((b, hkv, d), torch.bfloat16, 300 + step))
        pos = start.long() + step
        seq_lens.copy_(pos + 1)
        slots.copy_(_slots(table, pos))
        graph.replay()
        ref = paged_decode_ref(q, k_cache, v_cache, table, seq_lens)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
