"""One call's error stays that call's: merged generate() calls with a bad one among them.

A call with bad inputs is refused at the door (generate.validate, a ValueError naming the
argument and the limit); a merged step that still raises is run again without the call that
fails, so only that call gets the error and the others return their own tokens, equal to stock
greedy. Tiny random-weight models in float32 on CPU, after oxygen_torch.enable()."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T
from sim_steps import Steps
from test_engine import in_threads as _in_threads
from test_hf_generate import COMMON

import oxygen_torch
from oxygen_torch.config import SchedulerConfig
from oxygen_torch.engine import scheduler as sch
from oxygen_torch.engine.task import Task
from oxygen_torch.integrations.hf import batched
from oxygen_torch.integrations.hf import generate as gen

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

JOIN_S = 120  # a thread still alive after this is a hang


def llama(seed: int = 0):
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def good_calls(n: int) -> list[dict]:
    """n greedy calls of different prompt lengths and batch sizes (ids 1..99)."""
    kws = []
    for s in range(n):
        g = torch.Generator().manual_seed(100 + s)
        rows, length = 1 + s % 2, 5 + s % 7
        ids = torch.randint(1, 100, (rows, length), generator=g)
        kws.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=6 + s % 5))  # fmt: skip
    return kws


def generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


def in_threads(fn, args_list):
    """fn(*args) in one thread each, started together: ({i: result}, {i: exception})."""
    return _in_threads(fn, args_list, timeout=JOIN_S)


def merged_steps() -> dict:
    """enable()'s overrides that run concurrent calls as merged steps (engine/scheduler.py), the
    path these tests pin, where a switch to another engine loop exists."""
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return {"scheduler": {"engine": False}} if "engine" in fields else {}


@pytest.fixture
def enabled(oxygen):
    """A test that calls oxygen_torch.enable() (after building its stock answers): disabled
    after it (the `oxygen` fixture then cleans up the pools)."""
    yield lambda: oxygen_torch.enable(**merged_steps())
    oxygen_torch.disable()


def merged_rows(model) -> int:
    """The most rows a merged step of `model` carried."""
    mergers = batched._mergers.get(model, {}).values()
    return max((max(m.scheduler.stats.batch_sizes, default=0) for m in mergers), default=0)


# --- a token id outside the vocabulary -----------------------------------------------------------


@pytest.mark.parametrize("where", ["door", "step"])
def test_a_token_id_outside_the_vocabulary_fails_only_its_call(enabled, monkeypatch, where):
    """8 good calls and one whose prompt holds id 128 (vocab 128). "door": generate.validate
    refuses it (ValueError naming input_ids and the vocabulary). "step": with the check taken
    out, the merged step's embedding raises IndexError; the step is run again without it, and
    only that call gets the error, as stock gives it."""
    kws = good_calls(8)
    stock = llama()
    ref = [generate(stock, kw) for kw in kws]
    bad_ids = torch.tensor([[5, 6, 128, 7, 9]])
    bad = dict(input_ids=bad_ids, attention_mask=torch.ones_like(bad_ids), max_new_tokens=6,
               do_sample=False)  # fmt: skip
    with pytest.raises(IndexError):  # stock, for the record
        generate(stock, bad)
    if where == "step":
        monkeypatch.setattr(gen, "validate", lambda model, call, host_ids=None: None)
    enabled()
    model = llama()
    assert model.config._attn_implementation == "oxygen"
    for _ in range(2):
        out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws + [bad]])
        assert set(errors) == {8}, {i: repr(e) for i, e in errors.items()}
        if where == "door":
            assert isinstance(errors[8], ValueError)
            assert "input_ids" in str(errors[8]) and "128" in str(errors[8])
        else:
            assert isinstance(errors[8], IndexError)
        for i, r in enumerate(ref):
            assert torch.equal(out[i], r), f"call {i}"
    assert merged_rows(model) > 2  # the calls did share steps


# --- an exception raised inside the forward, for one call's rows ---------------------------------


class Boom(Exception):
    pass


class Force(T.LogitsProcessor):
    """Makes the call generate `token` as its new token number `at` (then its next forward
    carries it)."""

    def __init__(self, token: int, at: int):
        self.token, self.at, self.n = token, at, 0

    def __call__(self, input_ids, scores):
        self.n += 1
        if self.n == self.at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


def test_an_exception_in_one_calls_forward_fails_only_that_call(enabled):
    """A pre-hook on the embedding raises when it meets a marker token; one call is made to
    generate the marker (its fourth forward raises, inside a merged decode step), 12 good calls
    never see it. Only that call raises Boom; the others return stock's tokens."""
    kws = good_calls(12)
    stock = llama()
    ref = [generate(stock, kw) for kw in kws]
    seen = set(torch.cat([r.flatten() for r in ref]).tolist())
    marker = max(set(range(100, 128)) - seen)  # a token no good call reads or generates
    enabled()
    model = llama()

    def raise_on_marker(module, args):
        if bool((args[0] == marker).any()):
            raise Boom("an embedding hook raised for the marked call's rows")

    model.model.embed_tokens.register_forward_pre_hook(raise_on_marker)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    force = T.LogitsProcessorList([Force(marker, 3)])
    bad = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
               do_sample=False, logits_processor=force)  # fmt: skip
    for _ in range(2):
        bad["logits_processor"][0].n = 0
        out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws + [bad]])
        assert set(errors) == {12}, {i: repr(e) for i, e in errors.items()}
        assert isinstance(errors[12], Boom)
        for i, r in enumerate(ref):
            assert torch.equal(out[i], r), f"call {i}"
    assert merged_rows(model) > 2


# --- the scheduler alone: a failing request among many --------------------------------------------


class Picky(Steps):
    """A runner whose step raises while it holds a request whose payload is "bad"."""

    def __init__(self):
        super().__init__(step_s=0.0)

    def run(self, chunks):
        keys = sorted(ch.request.call.key for ch in chunks)
        self.log.append(keys)
        if any(ch.request.payload == "bad" for ch in chunks):
            raise ValueError("a bad request in the step")
        for ch in chunks:
            ch.request.result, ch.request.done = ch.request.call.key, True
        return True


@pytest.mark.parametrize("calls", [2, 9, 16])
def test_a_failing_step_is_run_again_without_the_request_that_fails(calls):
    runner = Picky()
    sched = sch.StepScheduler(SchedulerConfig(gather_ms=200.0), runner)
    live = [sched.enter(Task(), key=k) for k in range(calls)]

    def one(k):
        try:
            return sched.submit(live[k], "bad" if k == calls - 1 else "good")
        finally:
            sched.leave(live[k])

    out, errors = in_threads(one, [(k,) for k in range(calls)])
    assert set(errors) == {calls - 1} and isinstance(errors[calls - 1], ValueError)
    assert out == {k: k for k in range(calls - 1)}
    assert len(runner.log[0]) == calls  # one step first, then parts of it
    assert [calls - 1] in runner.log  # the failing request alone at last
    assert len(runner.log) <= 2 * calls - 1


# --- the door: inputs that would fail inside a forward ------------------------------------------

IDS = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(7))
REFUSED = {
    "a 1-D prompt": (dict(input_ids=IDS[0]), ["input_ids", "[9]"]),
    "an empty prompt": (dict(input_ids=IDS[:, :0]), ["input_ids", "length >= 1"]),
    "float ids": (dict(input_ids=IDS.float()), ["input_ids", "float32"]),
    "a negative id": (dict(input_ids=IDS - 50), ["input_ids", "[0, 128)"]),
    "an id past the vocabulary": (dict(input_ids=IDS + 100), ["input_ids", "[0, 128)"]),
    "a short mask": (
        dict(input_ids=IDS, attention_mask=torch.ones(2, 7, dtype=torch.long)),
        ["attention_mask", "[2, 7]", "[2, 9]"],
    ),
    "a 1-D mask": (
        dict(input_ids=IDS, attention_mask=torch.ones(9, dtype=torch.long)),
        ["attention_mask", "[9]"],
    ),
    "a mask of embeddings' other length": (
        dict(inputs_embeds=torch.randn(2, 9, 64), attention_mask=torch.ones(2, 7)),
        ["attention_mask", "[2, 9]"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_door_refuses_inputs_that_would_fail_in_a_forward(case):
    kw, words = REFUSED[case]
    model = llama()
    with pytest.raises(ValueError) as err:
        gen.validate(model, gen._Call(model, (), {**kw, "max_new_tokens": 4}))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_the_door_lets_through_what_stock_runs():
    """A one-row mask (stock broadcasts it) and a rotary model past max_position_embeddings
    (stock runs it on: no hard limit)."""
    model = llama()
    for kw in (
        dict(input_ids=IDS, attention_mask=torch.ones(1, 9, dtype=torch.long)),
        dict(input_ids=IDS, max_new_tokens=COMMON["max_position_embeddings"]),
        dict(inputs_embeds=torch.randn(2, 9, 64)),
    ):
        gen.validate(model, gen._Call(model, (), {"max_new_tokens": 4, **kw}))


def test_the_door_names_the_limit_of_learned_positions():
    """GPT-2 embeds learned absolute positions: 32 of them here; a 9-token prompt may take 23
    new tokens, not 24 (or a max_length past 32)."""
    torch.manual_seed(0)
    conf = T.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=128)
    model = T.GPT2LMHeadModel(conf).eval()
    gen.validate(model, gen._Call(model, (IDS,), {"max_new_tokens": 23}))
    with pytest.raises(
        ValueError, match=r"length 9 \+ max_new_tokens 24 = 33 positions.* at most 32"
    ):
        gen.validate(model, gen._Call(model, (IDS,), {"max_new_tokens": 24}))
    with pytest.raises(ValueError, match=r"max_length 40 positions.* at most 32"):
        gen.validate(model, gen._Call(model, (), {"input_ids": IDS, "max_length": 40}))
