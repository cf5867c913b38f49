"""Oversubscription (kv.oversubscribe, integrations/hf/oversubscribe.py): a generate() whose rows
need more KV than the pool holds completes as row groups, with the tokens of the same batch run
whole on a pool that holds it (float32, greedy: exactly the same tokens).

The small pool: kv.block_tokens 256 in an 8 MiB arena holds 15 blocks (one 2 MiB page per K and
V region of each of the two layers, a block of 128 KiB per region, one guard block); the large
one (64 MiB) holds 127."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
import torch
import transformers as T
from test_engine import in_threads, llama, schedulers

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import generate as gen
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import oversubscribe
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.block_manager import KVCacheFull

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

SMALL = {"block_tokens": 256, "arena_bytes": 8 << 20}  # 15 blocks
LARGE = {"block_tokens": 256, "arena_bytes": 64 << 20}  # 127 blocks


def pair(arch: str, merge: bool = True, small: dict | None = None, **pool):
    """The same random weights twice: on the 15-block pool and on the 127-block one."""
    kv = {**SMALL, **(small or {})}
    cfg = load_config(kv=kv, scheduler={"merge": merge}, pool=pool)
    return hf.apply(llama(arch=arch), cfg), hf.apply(llama(arch=arch), load_config(kv=LARGE))


def batch(seed: int, rows: int, length: int = 12):
    """Random prompts, left padded: row r has r % 6 padding columns (lengths differ)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : r % 6] = 0
        ids[r, : r % 6] = 0
    return ids, mask


def generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


def pool_of(blocks_total: int) -> dict:
    (p,) = [p for p in pool_stats() if p["blocks_total"] == blocks_total]
    return p


def an_eos_that_ends_rows_apart(model, kw) -> int:
    """A token the batch generates (greedy) at different steps in different rows, and in some
    rows not at all: as eos_token_id it makes rows end at different steps."""
    out = generate(model, {**kw, "eos_token_id": None})[:, kw["input_ids"].shape[1] :]
    for tok in out[:, 1:-1].flatten().tolist():
        first = [(row == tok).nonzero()[0].item() for row in out if bool((row == tok).any())]
        if len(set(first)) > 1 and len(first) < out.shape[0] and min(first) > 0:
            return tok
    raise AssertionError("no token ends rows at different steps")


def ended_apart(seqs: torch.Tensor, width: int, eos: int) -> None:
    """The reference shows rows ending at different steps, padded after their eos."""
    gen = seqs[:, width:]
    ends = {int((row == eos).nonzero()[0]) for row in gen if bool((row == eos).any())}
    assert len(ends) > 1 and any(not bool((row == eos).any()) for row in gen)


@pytest.mark.parametrize("merge", [True, False], ids=["engine", "no-engine"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_oversubscribed_batch_gives_the_tokens_of_a_batch_that_fits(oxygen, caplog, arch,
                                                                       merge):  # fmt: skip
    """20 rows of one block each on 15 blocks; an eos ends rows at different steps."""
    small, big = pair(arch, merge)
    ids, mask = batch(1, rows=20)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    kw["eos_token_id"] = an_eos_that_ends_rows_apart(big, kw)
    ref = generate(big, kw)
    ended_apart(ref, ids.shape[1], kw["eos_token_id"])
    with caplog.at_level(logging.INFO, logger="oxygen_torch"):
        out = generate(small, kw)
    assert torch.equal(out, ref)
    p = pool_of(15)
    # with the engine: groups of at most half the pool (7 rows), two at a time (merged by the
    # engine: see the concurrent test); without it, as large as the pool, one after the other
    groups = 3 if merge else 2
    assert p["oversubscribed"] == {"calls_split": 1, "groups_run": groups}
    assert p["peak_blocks_used"] <= 15 and p["blocks_used"] == 0
    assert pool_of(127)["oversubscribed"]["calls_split"] == 0
    (line,) = [r for r in caplog.records if "row groups" in r.getMessage()]
    assert line.levelno == logging.INFO and f"{groups} row groups" in line.getMessage()
    v = oversubscribe.judge(small, hf.config_of(small), gen._Call(small, (), kw), merge)
    assert [len(g) for g in v.groups] == ([7, 7, 6] if merge else [15, 5])
    assert v.concurrent == (2 if merge else 1) and (v.need, v.budget) == (20, 15)
    if not merge:
        assert not schedulers(small)  # one after the other, never through the engine


def test_return_dict_groups_give_their_blocks_back_as_they_end(oxygen):
    """return_dict_in_generate: each group's output holds its cache. Groups of 7, 7 and 6 rows,
    two at a time: the third starts on the blocks the first gave back, so a finished group's
    cache must not keep them (it would wait for them forever: run in a thread, with a time
    limit)."""
    small, big = pair("qwen3")
    ids, mask = batch(9, rows=20, length=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              return_dict_in_generate=True)  # fmt: skip
    ref = generate(big, kw)
    out, errors = in_threads(lambda: generate(small, kw), [()], timeout=120)
    assert not errors, errors
    assert type(out[0]) is type(ref) and torch.equal(out[0].sequences, ref.sequences)
    assert out[0].past_key_values is None
    p = pool_of(15)
    assert p["oversubscribed"] == {"calls_split": 1, "groups_run": 3} and p["blocks_used"] == 0


def test_num_return_sequences_families_stay_together(oxygen):
    """8 prompts x 3 return sequences (top_k=1 sampling: the greedy tokens whatever the random
    stream) need 24 blocks: groups of two prompts, each with its three rows."""
    small, big = pair("qwen3")
    ids, mask = batch(2, rows=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=1,
              num_return_sequences=3)  # fmt: skip
    ref = generate(big, kw)
    out = generate(small, kw)
    assert out.shape == (24, 18) and torch.equal(out, ref)
    assert pool_of(15)["oversubscribed"] == {"calls_split": 1, "groups_run": 4}


@pytest.mark.parametrize("merge", [True, False], ids=["engine", "no-engine"])
def test_beams_with_return_dict_reassemble_sequences_and_beam_indices(oxygen, merge):
    """6 prompts x 3 beams, 2 returned each, ending at different steps (eos): the dict output
    has the full batch's sequences and beam indices (shifted to its rows); no cache."""
    small, big = pair("llama", merge)
    ids, mask = batch(3, rows=6, length=10)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
              num_beams=3, num_return_sequences=2, return_dict_in_generate=True)  # fmt: skip
    kw["eos_token_id"] = an_eos_that_ends_rows_apart(big, {**kw, "return_dict_in_generate": False})
    ref = generate(big, kw)
    out = generate(small, kw)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    assert out.past_key_values is None and out.sequences_scores is None
    assert pool_of(15)["oversubscribed"]["calls_split"] == 1


def test_prefix_allowed_tokens_fn_sees_the_full_batchs_row_index(oxygen):
    """Row b may only generate token b + 3: each group asks for its rows by the full batch's
    index, not its own."""
    small, _ = pair("llama")
    ids, mask = batch(12, rows=20, length=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
              prefix_allowed_tokens_fn=lambda b, _ids: [b + 3])  # fmt: skip
    out = generate(small, kw)
    want = (torch.arange(20) + 3).view(20, 1).expand(20, 3)
    assert torch.equal(out[:, 8:], want)
    assert pool_of(15)["oversubscribed"]["calls_split"] == 1


def test_concurrent_calls_with_one_oversubscribed(oxygen, monkeypatch):
    """A low-priority call of 20 rows runs as groups of 7, 7 and 6 rows, two at a time (14 of
    the 15 blocks); two calls of 4 rows (normal priority) arrive once those two hold their
    blocks: a group, tagged low as its caller (the groups' threads carry its context), is
    preempted and swaps to the CPU tier. Every call gets the tokens it gets alone on
    the large pool, and the tier gives back what it took."""
    small, big = pair("llama", cpu_tier_bytes=64 << 20)
    # the first two groups start together: on a loaded machine the first one's thread could
    # run all its steps before the second's began, and 14 blocks were never held at once
    threads, gated_runs = oversubscribe._in_threads, []

    def together(fn, subs, workers, device):
        gated_runs.append(workers)
        gate, started = threading.Barrier(min(workers, len(subs))), itertools.count()

        def gated(sub):
            if next(started) < gate.parties:
                gate.wait(timeout=30)
            return fn(sub)

        return threads(gated, subs, workers, device)

    monkeypatch.setattr(oversubscribe, "_in_threads", together)
    ids, mask = batch(10, rows=20, length=8)
    kws = [dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)]
    for s in range(2):
        ids, mask = batch(11 + s, rows=4, length=9 + s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    refs = [generate(big, kw) for kw in kws]

    held = threading.Event()  # seen by either caller: the other may miss the moment (on a
    # loaded machine the first caller's call preempted a group before the second looked again)

    def call(i):
        if i == 0:
            with oxygen_torch.task(priority="low"):
                return generate(small, kws[0])
        deadline = time.monotonic() + 60
        while not held.is_set() and pool_of(15)["blocks_used"] < 14:
            # the first two groups hold their KV at once
            assert time.monotonic() < deadline, "the oversubscribed call's groups never ran"
            time.sleep(0.005)
        held.set()
        return generate(small, kws[i])  # normal priority: above the groups only if tagged low

    generate(small, dict(kws[1], max_new_tokens=1))  # makes the small pool the threads poll
    out, errors = in_threads(call, [(i,) for i in range(3)])
    assert not errors, errors
    for i, ref in enumerate(refs):
        assert torch.equal(out[i], ref), f"call {i}"
    p = pool_of(15)
    assert p["oversubscribed"] == {"calls_split": 1, "groups_run": 3} and gated_runs == [2]
    (sched,) = schedulers(small)
    assert max(sched.stats.batch_sizes) >= 11  # a group's 7 rows with another call's 4 or more
    assert sched.stats.swaps > 0  # a group swapped out and back, not recomputed
    assert p["cpu_tier"]["bytes_up"] == p["cpu_tier"]["bytes_down"] > 0
    assert p["cpu_tier"]["slots_used"] == 0 and p["blocks_used"] == 0
    assert p["peak_blocks_used"] <= 15


def test_the_rule_is_exact_at_the_pool_size(oxygen):
    """Rows of 250 real tokens store 250 + max_new_tokens - 1: 256 (one block) with 7 new
    tokens, 257 (two) with 8; rows of 251 take two with 7. Seven one-block rows and four
    two-block rows need exactly the 15 blocks: not split, and the pool's peak is 15. One more
    new token makes every row two blocks, 22: split."""
    small, big = pair("llama")
    ids = torch.randint(1, 128, (11, 252), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[:7, :2], ids[:7, :2] = 0, 0  # rows 0-6: 250 real tokens
    mask[7:, :1], ids[7:, :1] = 0, 0  # rows 7-10: 251 (two blocks with 7 new tokens)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(generate(small, kw), generate(big, kw))
    p = pool_of(15)
    assert p["oversubscribed"]["calls_split"] == 0 and p["peak_blocks_used"] == 15
    kw["max_new_tokens"] = 8  # every row: two blocks
    assert torch.equal(generate(small, kw), generate(big, kw))
    assert pool_of(15)["oversubscribed"] == {"calls_split": 1, "groups_run": 4}


def test_a_row_family_larger_than_the_pool_says_so(oxygen):
    """Two prompts of 8 return sequences each: a family of 8 fits, one of 16 does not."""
    small, _ = pair("llama")
    ids, mask = batch(5, rows=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=1,
              num_return_sequences=16)  # fmt: skip
    with pytest.raises(KVCacheFull, match=r"prompt row 0 .* alone needs 16 blocks.*kv\.arena"):
        generate(small, kw)
    assert pool_of(15)["blocks_used"] == 0
    kw["num_return_sequences"] = 8  # 16 rows in families of 8: two groups, one after the other
    assert generate(small, kw).shape == (16, 16)
    assert pool_of(15)["oversubscribed"] == {"calls_split": 1, "groups_run": 2}


@pytest.mark.parametrize("merge", [True, False], ids=["engine", "no-engine"])
def test_oversubscribe_off_gives_the_kv_error_naming_the_setting(oxygen, merge):
    small, _ = pair("llama", merge, small={"oversubscribe": False})
    ids, mask = batch(6, rows=20)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with pytest.raises(KVCacheFull, match=r"needs up to 20 KV blocks.*holds 15.*kv\.oversubscribe"):
        generate(small, kw)
    assert pool_of(15)["oversubscribed"]["calls_split"] == 0


class Collect(T.generation.BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize(
    "extra, name",
    [
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        (dict(return_dict_in_generate=True, output_logits=True), "output_logits"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
        (dict(streamer=Collect()), "streamer"),
    ],
)
def test_outputs_groups_cannot_give_are_refused_only_when_oversubscribed(oxygen, extra, name):
    small, _ = pair("llama")
    ids, mask = batch(7, rows=20, length=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **extra)
    with pytest.raises(ValueError, match=rf"{name} cannot be given.*kv\.arena_bytes"):
        generate(small, kw)
    if name != "streamer":  # (a streamer takes one row: transformers refuses a batch)
        kw.update(input_ids=ids[:4], attention_mask=mask[:4])
        generate(small, kw)  # fits: runs as asked


@pytest.mark.cuda
def test_oversubscribed_groups_on_the_callers_cuda_stream(oxygen):
    """On a GPU, the groups' threads run on the stream the caller generates on (its inputs were
    written there). float32; the GPU kernels' reductions depend on the batch, so tokens are
    compared by agreement, as tests/test_engine_cuda.py does."""
    small, big = pair("qwen3")
    small.cuda()
    big.cuda()
    ids, mask = batch(8, rows=20)
    kw = dict(max_new_tokens=8, do_sample=False)
    ref = generate(big, dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), **kw))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ids_s, mask_s = ids.pin_memory().cuda(non_blocking=True), mask.cuda()  # on `side` only
        out = generate(small, dict(input_ids=ids_s, attention_mask=mask_s, **kw))
    side.synchronize()
    assert out.shape == ref.shape
    agree = (out == ref).float().mean().item()
    print(f"\noversubscribed vs whole on the GPU: token agreement {agree:.4f}")
    assert agree >= 0.9
    p = pool_of(15)
    assert p["oversubscribed"] == {"calls_split": 1, "groups_run": 3} and p["blocks_used"] == 0
