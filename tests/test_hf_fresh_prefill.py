"""generate() with kv.fresh_prefill dense and paged gives the same tokens (and stock's), and
oxygen_torch.compile.stats() reports which path each prefill attention took; a chunked prefill's
later chunks read the cache, so they stay paged."""

from __future__ import annotations

import pytest
import torch
from test_hf_generate import batch, input_shapes, tiny

import oxygen_torch.compile as oc
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import PagedKVCache
from oxygen_torch.integrations.hf import integration as hf

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

LAYERS = 2  # tiny()'s num_hidden_layers


@pytest.fixture
def oxygen():
    yield hf
    hf.disable_hf()


def _generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **kw)  # fmt: skip


# llama: full attention; mistral: every layer sliding (window 8 < 13 prompt tokens); qwen3
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_dense_and_paged_fresh_prefill_give_the_same_tokens(arch, oxygen):
    model = tiny(arch, seed=3)
    ids, mask = batch(b=3, n=13, seed=4, pads=(4, 2, 0))
    with torch.no_grad():
        ref = _generate(model, ids, mask)
        got = {}
        for setting in ("dense", "paged"):
            oc.reset_stats()
            hf.apply(model, load_config(fresh_prefill=setting))
            got[setting] = _generate(model, ids, mask)
            assert isinstance(got[setting].past_key_values, PagedKVCache)
            paths = oc.stats()["prefill_attention"]
            # one prefill forward: every layer took the setting's path; decode is never counted
            assert paths["dense" if setting == "dense" else "paged"] == LAYERS, paths
            assert paths["dense" if setting == "paged" else "paged"] == 0, paths
            assert paths["why"] == {f"kv.fresh_prefill={setting}": LAYERS}
    dense, paged = got["dense"], got["paged"]
    assert torch.equal(dense.sequences, paged.sequences)
    assert torch.equal(dense.sequences, ref.sequences)
    for a, b, r in zip(dense.logits, paged.logits, ref.logits):
        scale = r.abs().max()
        assert ((a - b).abs().max() / scale) < 1e-5
        assert ((a - r).abs().max() / scale) < 1e-5


def test_auto_on_cpu_takes_the_dense_path(oxygen):
    model = tiny("llama")
    ids, mask = batch(b=2, n=11, pads=(3, 0))
    oc.reset_stats()
    with torch.no_grad():
        hf.apply(model)
        _generate(model, ids, mask)
    paths = oc.stats()["prefill_attention"]
    assert paths["dense"] == LAYERS and paths["paged"] == 0
    assert list(paths["why"]) == ["auto: CPU: the paged path is SDPA after a gather"]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_takes_dense_for_the_first_chunk_only(arch, oxygen):
    """3 x 40 prompt tokens over kv.prefill_chunk_tokens=48: three chunks of 16, 16, 8; only the
    first is fresh (the later ones attend the cached chunks before them)."""
    model = tiny(arch, seed=1)
    ids, mask = batch(b=3, n=40, seed=2, pads=(7, 5, 0))
    shapes = input_shapes(model)
    with torch.no_grad():
        ref = _generate(model, ids, mask)
        got = {}
        for setting in ("dense", "paged"):
            hf.apply(model, load_config(prefill_chunk_tokens=48, fresh_prefill=setting))
            oc.reset_stats()
            shapes.clear()
            got[setting] = _generate(model, ids, mask)
            assert [n for _, n in shapes[:3]] == [16, 16, 8], shapes
            paths = oc.stats()["prefill_attention"]
            if setting == "dense":
                assert paths["dense"] == LAYERS and paths["paged"] == 2 * LAYERS, paths
                assert paths["why"]["cached prefix"] == 2 * LAYERS
            else:
                assert paths["dense"] == 0 and paths["paged"] == 3 * LAYERS, paths
    assert torch.equal(got["dense"].sequences, got["paged"].sequences)
    assert torch.equal(got["dense"].sequences, ref.sequences)
