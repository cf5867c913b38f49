"""The multi-task engine on CPU: concurrent generate() calls on one model, merged step by step.

Every test compares each call with the same call run alone (float32, greedy: exactly the same
tokens), and reads the step scheduler's figures to see that steps were merged."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import threading
import time
import traceback

import pytest
import torch
import transformers as T
from test_hf_generate import COMMON

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.engine.policy import WFQ, Account
from oxygen_torch.engine.task import Task, current, parse
from oxygen_torch.integrations.hf import batched
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf.cache import PagedKVCache
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.pool import get_pool

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call


def llama(seed=0, arch="llama"):
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON)).eval()
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def prompt(seed: int, rows: int, length: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[0, : seed % 5] = 0  # left padding, different per call
        ids[0, : seed % 5] = 0
    return ids, mask


def call_kw(seed: int) -> dict:
    """A call's own arguments: lengths, batch, beams, stop criteria differ from call to call."""
    ids, mask = prompt(seed, rows=1 + seed % 3, length=6 + 3 * (seed % 4))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5 + 2 * (seed % 5))
    kw["do_sample"] = False
    if seed % 4 == 3:
        kw["num_beams"] = 2
    if seed % 5 == 4:
        kw["eos_token_id"] = 7  # stops early where it is generated
    return kw


def generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


def in_threads(fn, args_list, timeout=300):
    out, errors = {}, {}
    barrier = threading.Barrier(len(args_list))

    def work(i, args):
        barrier.wait()
        try:
            out[i] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errors[i] = err

    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a generate() thread hung"
    return out, errors


def together_as_alone(model, kws: list[dict], label: str = "") -> None:
    """Each call run alone, then all at once from threads: no error, the same tokens."""
    ref = [generate(model, kw) for kw in kws]  # one by one: each call alone
    out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws])
    # (with where each was raised: a rare failure in the whole suite is read from CI's log)
    assert not errors, {i: "".join(traceback.format_exception(e)) for i, e in errors.items()}
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"{label} call {i}"


def schedulers(model):
    return [m.scheduler for m in batched._mergers.get(model, {}).values()]


@pytest.mark.parametrize("threads", [2, 5, 16])
def test_concurrent_calls_give_the_tokens_they_give_alone(oxygen, threads):
    model = hf.apply(llama())
    calls = [call_kw(s) for s in range(threads)]
    alone = max(kw["input_ids"].shape[0] * kw.get("num_beams", 1) for kw in calls)
    # several calls' sequences in one forward: on a loaded machine two threads may not overlap
    # in one round (one ends before the other's first step), so up to three rounds
    for _ in range(3):
        together_as_alone(model, calls)
        (sched,) = schedulers(model)
        if max(sched.stats.batch_sizes) > alone:
            break
    assert max(sched.stats.batch_sizes) > alone, sched.stats.batch_sizes
    assert sched.live() == 0


def test_sampling_calls_get_their_own_logits(oxygen):
    """Sampled tokens depend on the shared random stream, so each call's recorded logits are
    checked against the model run alone on the tokens that call produced."""
    model = hf.apply(llama(seed=3, arch="qwen3"))
    kws = []
    for s in range(4):
        ids, mask = prompt(s + 20, rows=2, length=8)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                        temperature=0.8, top_k=20, output_logits=True,
                        return_dict_in_generate=True))  # fmt: skip
    out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws])
    # (with where each was raised: a rare failure in the whole suite is read from CI's log)
    assert not errors, {i: "".join(traceback.format_exception(e)) for i, e in errors.items()}
    stock = llama(seed=3, arch="qwen3")
    stock.config._attn_implementation = "sdpa"
    for i, kw in enumerate(kws):
        seq = out[i].sequences
        p = kw["input_ids"].shape[1]
        mask = torch.cat([kw["attention_mask"], torch.ones_like(seq[:, p:])], 1)
        with torch.no_grad():
            truth = stock(seq, attention_mask=mask).logits[:, p - 1 : -1]
        got = torch.stack(out[i].logits, 1)
        torch.testing.assert_close(got, truth, rtol=1e-4, atol=1e-4)


def test_a_burst_larger_than_the_kv_budget_completes_without_oom(oxygen):
    """31 KV blocks of 128 tokens; ten calls of two rows that each end at 2 blocks a row need
    40: calls wait for blocks and younger ones are preempted (recomputed), none fails."""
    cfg = load_config(kv={"block_tokens": 128, "arena_bytes": 8 << 20})
    model = hf.apply(llama(), cfg)
    kws = []
    for s in range(10):
        ids, mask = prompt(s, rows=2, length=100 + s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    together_as_alone(model, kws)
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    assert pool["peak_blocks_used"] <= pool["blocks_total"] == 31
    assert schedulers(model)[0].stats.preemptions > 0


def test_a_step_of_calls_that_have_not_run_counts_the_blocks_of_their_pool(oxygen):
    """Calls none of which has run a forward yet are counted against the KV pool they will
    bind to, another call's blocks held in it (they were counted against no pool: a step was
    planned past the blocks it found and served nothing; under tensor parallelism a rank with
    the room ran it alone and the ranks' collectives hung, test_tp_gloo), and such a step is
    planned within those blocks."""
    cfg = load_config(kv={"block_tokens": 128, "arena_bytes": 8 << 20})
    model = hf.apply(llama(), cfg)
    ids, mask = prompt(int(torch.randint(0, 100, ()).item()), rows=2, length=200)
    with torch.no_grad():  # a finished call whose cache (output) still holds 4 blocks
        held = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                              return_dict_in_generate=True)  # fmt: skip
    text = model.config.get_text_config(decoder=True)
    fresh = [PagedKVCache(config=text, cfg=cfg) for _ in range(3)]
    merger = batched.merger_for(model, fresh[0])
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(batched.session(model, c, Task())) for c in fresh]
        assert all(c._core.pool is None for c in fresh)
        pool = get_pool(fresh[0]._core.pool_key(*batched._geometry(model)))
        m = pool.manager
        assert merger.total_blocks() == m.num_blocks - m.first_id == 31
        assert merger.free_blocks() == m.num_available < 31
        # three fresh calls of 3 rows x 1,000 tokens (24 blocks each): one step takes one
        big = torch.randint(1, 128, (3, 1000))
        for c, call in zip(fresh, calls):
            work = batched.Work(c, "past_key_values", big, torch.ones_like(big, dtype=torch.bool),
                                torch.arange(1000).expand(3, -1), 1)  # fmt: skip
            call.queued = batched.Request(call, work)
        merger.scheduler._told = {"preempt": [], "errors": []}
        chosen = merger.scheduler._select()
        assert [ch.blocks for ch in chosen] == [24]
    del held
    gc.collect()


class Boom(Exception):
    pass


class RaiseAt(T.LogitsProcessor):
    def __init__(self, step):
        self.step, self.n = step, 0

    def __call__(self, input_ids, scores):
        self.n += 1
        if self.n == self.step:
            raise Boom("a logits processor failed")
        return scores


def test_a_call_that_raises_leaves_the_others_correct_and_frees_its_blocks(oxygen):
    model = hf.apply(llama())
    kws = [call_kw(s) for s in range(4)]
    ref = [generate(model, kw) for kw in kws]
    bad = {**call_kw(9), "logits_processor": T.LogitsProcessorList([RaiseAt(3)])}
    out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws + [bad]])
    assert set(errors) == {4} and isinstance(errors[4], Boom)
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r)
    del out, errors
    gc.collect()
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


def test_a_finished_call_gives_its_blocks_back_before_it_leaves_the_scheduler(oxygen, monkeypatch):
    """A call left alone runs its forwards by itself, without preemption: a finished call's
    blocks must be back before it leaves, not when its cache object is collected (a loaded
    machine's thread held them past its leave, and the call left alone hit KVCacheFull). Its
    cache is kept alive here; an output that holds its cache keeps the blocks."""
    from oxygen_torch.integrations.hf import generate as hf_gen

    model = hf.apply(llama())
    kept, finish = [], hf_gen.finish
    monkeypatch.setattr(hf_gen, "finish", lambda c, o: (kept.append(c), finish(c, o))[1])
    ids, mask = prompt(3, rows=3, length=40)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    ref = generate(model, kw)
    assert len(kept) == 1 and kept[0].merge is None  # alive, out of the scheduler
    assert sum(p["blocks_used"] for p in pool_stats()) == 0
    out = generate(model, {**kw, "return_dict_in_generate": True})
    assert out.past_key_values is kept[1] and torch.equal(out.sequences, ref)
    held = sum(p["blocks_used"] for p in pool_stats())
    assert held == 3 * -(-(40 + 20) // kept[1].cfg.kv.block_tokens)  # the output's blocks
    del out, kept[:]
    gc.collect()
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


class Slow(T.LogitsProcessor):
    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, input_ids, scores):
        time.sleep(self.seconds)
        return scores


def test_a_slow_caller_does_not_hold_the_others_back(oxygen):
    model = hf.apply(llama(), load_config(scheduler={"gather_ms": 20}))
    fast = [call_kw(s) for s in (0, 1, 2)]
    slow = {**call_kw(5), "logits_processor": T.LogitsProcessorList([Slow(0.3)])}
    slow["max_new_tokens"] = 6
    ref = [generate(model, kw) for kw in fast]
    done = {}

    def run(kw, tag):
        out = generate(model, kw)
        done[tag] = time.monotonic()
        return out

    start = time.monotonic()
    out, errors = in_threads(run, [(kw, i) for i, kw in enumerate(fast)] + [(slow, "slow")])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r)
    # the fast calls finish long before the slow one's 6 x 0.3 s
    assert max(done[i] for i in range(3)) - start < 0.6 * (done["slow"] - start)


def test_priority_changes_per_token_service_on_a_deterministic_trace(oxygen):
    """One sequence a step: with WFQ the high-priority calls' tokens are served first, so they
    finish before the low ones although they asked last; with FCFS arrival order decides."""
    finish = {}
    for policy in ("wfq", "fcfs"):
        cfg = load_config(scheduler={"policy": policy, "max_step_seqs": 1, "gather_ms": 200})
        model = hf.apply(llama(), cfg)
        order = []

        def run(kw, prio, tag, model=model, order=order):
            with oxygen_torch.task(priority=prio, name=tag):
                out = generate(model, kw)
            order.append(tag)
            return out

        kws = [dict(call_kw(10 + s), max_new_tokens=12, num_beams=1) for s in range(4)]
        for kw in kws:
            kw["input_ids"], kw["attention_mask"] = prompt(30, rows=1, length=6)
            kw.pop("eos_token_id", None)
        tags = [("low", "low-0"), ("low", "low-1"), ("high", "high-0"), ("high", "high-1")]
        out, errors = in_threads(run, [(kw, p, t) for kw, (p, t) in zip(kws, tags)])
        assert not errors, errors
        finish[policy] = order
        hf.disable_hf()
    assert set(finish["wfq"][:2]) == {"high-0", "high-1"}, finish
    assert finish["wfq"] != finish["fcfs"] or set(finish["fcfs"][:2]) == {"high-0", "high-1"}


def test_wfq_weights_follow_qos_and_keep_no_idle_credit():
    policy = WFQ(0.7, 0.3)
    hi, lo = Account(parse("high")), Account(parse("low"))
    policy.reweigh([hi, lo])
    assert hi.weight > lo.weight
    for _ in range(10):
        first = policy.order([hi, lo])[0]
        policy.charge(first, 10)
    assert hi.served > lo.served > 0  # served more, never starving the other
    late = Account(Task(level=1, qos=0.5))
    policy.join(late, [hi, lo])
    assert late.vtime == min(hi.vtime, lo.vtime)  # no credit banked while it was away


def test_task_tags_are_per_context_and_reach_an_executor():
    with oxygen_torch.task(priority="high", name="chat") as t:
        assert current() is t and t.level == 2 and t.qos == 1.0

        async def main():
            loop = asyncio.get_running_loop()
            ctx = contextvars.copy_context()
            return await loop.run_in_executor(None, ctx.run, current)

        assert asyncio.run(main()).name == "chat"
    assert current().name == "default"
    with pytest.raises(ValueError, match="task priority: 'urgent'"):
        parse("urgent")
    with pytest.raises(ValueError, match="task qos"):
        parse("high", qos=1.5)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "qwen2"])
def test_merged_calls_on_sliding_window_architectures(oxygen, arch):
    """Windows shorter than the prompts (the window really cuts), left padding: merged calls
    give the tokens they give alone."""
    from test_hf_generate import tiny

    model = hf.apply(tiny(arch))
    kws = []
    for s in range(4):
        ids, mask = prompt(40 + s, rows=2, length=12 + 2 * s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    together_as_alone(model, kws, arch)
    assert max(schedulers(model)[0].stats.batch_sizes) > 2


class Started(T.LogitsProcessor):
    """Sets an event once its call has produced `after` tokens; then, given `until`, holds its
    call (at most 60 s) until `until()` is true."""

    def __init__(self, event, after, until=None):
        self.event, self.after, self.n, self.until = event, after, 0, until

    def __call__(self, input_ids, scores):
        self.n += 1
        if self.n == self.after:
            self.event.set()
            deadline = time.monotonic() + 60
            while self.until is not None and not self.until() and time.monotonic() < deadline:
                time.sleep(0.002)
        return scores


def test_a_low_priority_call_running_alone_is_preempted_for_a_high_one(oxygen):
    """The batch job started alone (its steps ran unmerged, decode graphs' bookkeeping
    included); a chat call arrives, and when their KV no longer fits the low one is preempted
    (its tokens, recorded while it ran alone, recomputed): both give their tokens alone."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**COMMON, "max_position_embeddings": 1024}))
    model = model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    hf.apply(model, load_config(kv={"block_tokens": 128, "arena_bytes": 8 << 20}))  # 31 blocks
    # low: 4 rows of 300 + 150 (12 blocks when the chat call comes, 16 at most); high: 4 rows of
    # 420 + 150 (16, then 20): the two no longer fit once the high call is past 92 tokens, long
    # before the low one ends, however their steps interleave
    low_ids, low_mask = prompt(50, rows=4, length=300)
    high_ids, high_mask = prompt(51, rows=4, length=420)
    low_kw = dict(input_ids=low_ids, attention_mask=low_mask, max_new_tokens=150, do_sample=False)
    high_kw = dict(input_ids=high_ids, attention_mask=high_mask, max_new_tokens=150,
                   do_sample=False)  # fmt: skip
    ref_low, ref_high = generate(model, low_kw), generate(model, high_kw)
    started, preempted = threading.Event(), []
    sched_seen = []

    def chat_arrived():  # the low call waits for it after 5 tokens (a slow thread start)
        return any(c.account.task.name == "chat" for s in schedulers(model) for c in s._calls)

    def low():
        held = Started(started, 5, until=chat_arrived)
        kw = dict(low_kw, logits_processor=T.LogitsProcessorList([held]))
        with oxygen_torch.task(priority="low", name="batch"):
            return generate(model, kw)

    def high():
        assert started.wait(120)
        for s in schedulers(model):
            if not sched_seen:
                s.observers.append(lambda e, c, **f: e == "preempted" and preempted.append(c))
                sched_seen.append(s)
        with oxygen_torch.task(priority="high", name="chat"):
            return generate(model, high_kw)

    out, errors = in_threads(lambda f: f(), [(low,), (high,)])
    assert not errors, errors
    assert torch.equal(out[0], ref_low) and torch.equal(out[1], ref_high)
    assert preempted and all(c.account.task.name == "batch" for c in preempted)


def test_calls_that_sample_one_after_the_other_keep_stepping_together():
    """Four calls whose own code runs one after the other (as under the interpreter lock), 15 ms
    each: the last comes back 60 ms after a step, past gather_ms (25 ms) from the first, within
    a step's time (200 ms). Each step must wait for them all while they keep coming. (The rule
    before, gather_ms from the oldest request, split them into two groups a step apart: at least
    12 steps, at most 2 of all four; history.md has both.)"""
    from sim_steps import Steps

    from oxygen_torch.config import SchedulerConfig
    from oxygen_torch.engine import scheduler as sch

    runner = Steps(step_s=0.2)
    sched = sch.StepScheduler(SchedulerConfig(gather_ms=25.0), runner)
    calls = {k: sched.enter(Task(), key=k) for k in "ABCD"}
    interpreter = threading.Lock()

    def loop(key):
        for _ in range(8):
            sched.submit(calls[key], None)
            with interpreter:
                time.sleep(0.015)  # sampling, one call at a time
        sched.leave(calls[key])

    _, errors = in_threads(loop, [(k,) for k in "ABCD"])
    assert not errors, errors
    together = sum(step == list("ABCD") for step in runner.log)
    assert len(runner.log) <= 10 and together >= 6, runner.log
