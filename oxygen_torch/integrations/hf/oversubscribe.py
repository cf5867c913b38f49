"""Oversubscription (kv.oversubscribe): a generate() whose batch needs more KV than the pool
holds runs as groups of rows that fit, and returns what one call would.

The rule, decided per call before it starts, from the call's own arguments: row r of the
prompt stores `real_r + new - 1` tokens at most (its real prompt tokens, from the attention mask
or the whole width without one, padding is never stored; `new` = max_new_tokens, or max_length
minus the width; the last token generated is never fed back), so its `expand` rows (num_beams,
else num_return_sequences) need `expand * ceil((real_r + new - 1) / block_tokens)` blocks. The
call is oversubscribed when the sum over rows exceeds the pool's blocks (what the engine's
admission measures a request against: KVBudgetError). Exact for rows that run to
max_new_tokens; an upper bound when an EOS stops them, beams share blocks, or the prefix cache
gives a prompt's blocks. A model whose every layer has one sliding window (kv/window.py) holds a
row's window, margin and partial block at most once its prompt is in (the prompt whole, or a
prefill chunk more than the window, while it is).

The prompt rows (each with its expanded rows: a family stays together) are cut, in order, into
groups that each need at most half the pool when the multi-task engine merges calls
(scheduler.merge), so two or more run at once and the next group's prefill merges with the
running ones' decode; a group the engine preempts swaps to the CPU tier (pool.cpu_tier_bytes)
or is recomputed. `T // largest group` groups run at a time, from threads (each in a copy of the
caller's context: task tags; the caller's CUDA stream and inference mode). Without the engine
the groups are as large as the pool and run one after the other, in the caller's thread.

The result is the one call's: `sequences` padded with pad_token_id to the longest group (a
full batch pads its finished rows the same way); with return_dict_in_generate, `beam_indices`
are shifted to the full batch's rows and padded with -1, and `past_key_values` is None (the
groups' caches are not one cache). Scores, logits, attentions and hidden states cannot be put
together from groups (a full batch keeps computing its finished rows) and a streamer would see
the groups' tokens interleaved: an oversubscribed call asking for them is refused, naming the
option. Sampled tokens differ from the full batch's (the random stream is drawn per group, in
the order the groups step); max_time and logits processors / stopping criteria apply to each
group. A call that cannot be split (a family alone needs more than the pool, a per-row argument
this module does not know, assisted decoding, kv.oversubscribe off) runs whole, as before, and
its KV error says why it was not split.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ...engine.scheduler import KVBudgetError
from ...kv.block_manager import KVCacheFull
from ...kv.pool import KVPool, get_pool
from ...triton_kernels._checks import SUPPORTED_HEAD_DIMS
from . import compat
from . import generate as gen
from .cache import PagedKVCache

log = logging.getLogger("oxygen_torch")

KV_ERRORS = (KVCacheFull, KVBudgetError)
# Per-row arguments a group gets its own rows of ("inputs" is also the first positional one).
_PER_ROW = ("inputs", "input_ids", "attention_mask", "inputs_embeds", "position_ids",
            "token_type_ids")  # fmt: skip
_NOT_SPLIT = ("assistant_model", "prompt_lookup_num_tokens")  # they crop and re-verify the cache
_NOT_ASSEMBLED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class Verdict:
    """An oversubscribed call: what it needs, the pool's blocks, and its row groups (None: it
    runs whole, for `reason`)."""

    pool: KVPool
    need: int  # KV blocks, the rule above
    budget: int  # the pool's blocks
    block_tokens: int
    rows: int  # prompt rows
    expand: int
    groups: list[range] | None  # prompt rows of each group
    concurrent: int = 1
    reason: str = ""

    def explain(self, err: BaseException) -> BaseException:
        """`err` (a KV error of the whole call) with why the call was not split."""
        return type(err)(
            f"{err}; this generate() needs up to {self.need} KV blocks of {self.block_tokens} "
            f"tokens (prompt + max_new_tokens per row, or a sliding window's worth), the KV pool "
            f"holds {self.budget}, and it "
            f"was not split into row groups: {self.reason}"
        )


def judge(model, cfg, call: gen._Call, merged: bool) -> Verdict | None:
    """The call's verdict when its rows do not all fit in the pool; None when they fit (or it
    does not run on the paged cache). Raises ValueError for an oversubscribed call asking for
    outputs that groups cannot give."""
    kwargs = call.kwargs
    if not _on_paged_cache(model, call, kwargs) or call.prompt_shape() is None:
        return None
    batch, width = call.prompt_shape()
    new = call.max_length() - width
    if new <= 0:
        return None
    cache = call.empty_cache(cfg)  # its pool; plan gives the same (unbound) cache to the call
    pool = get_pool(cache._core.pool_key(*call.geometry()))
    bt = pool.key.block_tokens
    budget = pool.manager.num_blocks - pool.manager.first_id
    expand = max(call.opt("num_beams") or 1, call.opt("num_return_sequences") or 1)
    if batch * expand * -(-(width + new - 1) // bt) <= budget:
        return None  # fits even counting padding: no look at the mask (a device sync)
    real = _real_tokens(call, batch, width)
    held = _held_at_most(cache._core.window, bt, new, gen._chunk(call, cfg))
    needs = [expand * held(n) for n in real]
    if sum(needs) <= budget:
        return None
    v = Verdict(pool, sum(needs), budget, bt, batch, expand, None)
    v.reason = _why_whole(cfg, call, kwargs, batch, needs, budget)
    if v.reason:
        return v
    _refuse_outputs(call, v)
    v.groups = _groups(needs, budget // 2 if merged and max(needs) <= budget // 2 else budget)
    largest = max(sum(needs[r] for r in g) for g in v.groups)
    v.concurrent = max(1, budget // largest) if merged else 1
    return v


def _held_at_most(window: int | None, bt: int, new: int, chunk: int | None):
    """blocks(real prompt tokens) a row holds at most: all it stores, or with a sliding window
    on every layer (kv/window.py) its window, margin and partial block, and while the prompt is
    prefilled its whole prompt (or a prefill chunk more than the window)."""

    def stored(n: int) -> int:
        return -(-(n + new - 1) // bt)

    if window is None:
        return stored
    kept = -(-(window + bt) // bt) + 1

    def held(n: int) -> int:
        prompt = -(-n // bt) + 1
        if chunk is not None:
            prompt = min(prompt, kept + -(-chunk // bt))
        return min(stored(n), max(kept, prompt))

    return held


def _on_paged_cache(model, call, kwargs: dict) -> bool:
    """Whether generate.plan gives this call a PagedKVCache (the same tests, no side effects)."""
    if compat.cache_arg(type(model)) is None or compat.given_cache(kwargs) is not None:
        return False
    if gen._stock_reason(model, call) is not None:
        return False
    text = model.config.get_text_config(decoder=True)
    return call.device_type() != "cuda" or compat.head_dim(text) in SUPPORTED_HEAD_DIMS


def _real_tokens(call, batch: int, width: int) -> list[int]:
    mask = call.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (batch, width):
        return [int(n) for n in mask.sum(1).tolist()]
    return [width] * batch  # no mask: padding is inferred later; the whole width is the bound


def _why_whole(cfg, call, kwargs: dict, batch: int, needs: list[int], budget: int) -> str:
    """Why an oversubscribed call runs whole ("" when it can be split)."""
    if not cfg.kv.oversubscribe:
        return "kv.oversubscribe is off (true runs it as row groups that fit)"
    if batch < 2:
        return (
            f"its one prompt row (with num_beams / num_return_sequences: {needs[0]} blocks) "
            "cannot be split; raise kv.arena_bytes or lower max_new_tokens"
        )
    if max(needs) > budget:
        r = needs.index(max(needs))
        return (
            f"prompt row {r} with its {call.opt('num_beams') or 1} beam(s) / "
            f"{call.opt('num_return_sequences') or 1} return sequence(s) alone needs "
            f"{needs[r]} blocks, more than the pool; raise kv.arena_bytes, lower "
            "max_new_tokens, num_beams or num_return_sequences"
        )
    for name in _NOT_SPLIT:
        if call.opt(name) is not None:
            return f"{name} is given (assisted decoding is not split)"
    for name, value in kwargs.items():
        if name in _PER_ROW or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.shape[0] == batch:
            return f"argument {name!r} looks per-row and is not one oxygen_torch knows how to split"
    return ""


def _refuse_outputs(call, v: Verdict) -> None:
    asked = [n for n in _NOT_ASSEMBLED if call.opt(n)]
    if not call.opt("return_dict_in_generate"):
        asked = []  # generate() returns the sequences only: nothing else to put together
    if call.kwargs.get("streamer") is not None:
        asked.append("streamer")
    if asked:
        raise ValueError(
            f"oxygen_torch: this generate() needs up to {v.need} KV blocks, the KV pool holds "
            f"{v.budget}, so it runs as groups of rows (kv.oversubscribe), and "
            f"{', '.join(asked)} cannot be given for a batch run in groups (a full batch keeps "
            "computing its finished rows): lower the batch, raise kv.arena_bytes, or leave "
            f"out {', '.join(asked)}"
        )


def _groups(needs: list[int], cap: int) -> list[range]:
    """Consecutive prompt rows, each group needing at most `cap` blocks (every row fits alone)."""
    groups, start, held = [], 0, 0
    for r, n in enumerate(needs):
        if r > start and held + n > cap:
            groups.append(range(start, r))
            start, held = r, 0
        held += n
    groups.append(range(start, len(needs)))
    return groups


def run(model, v: Verdict, args: tuple, kwargs: dict, generate_fn):
    """The call, as its row groups (each through `generate_fn(model, *args, **kwargs)`),
    reassembled."""
    call = gen._Call(model, args, kwargs)
    log.info(
        "oxygen_torch: generate() of %d rows (x%d) needs up to %d KV blocks, the pool holds %d: "
        "running it as %d row groups, %d at a time (kv.oversubscribe)",
        v.rows, v.expand, v.need, v.budget, len(v.groups), v.concurrent,
    )  # fmt: skip
    with v.pool.lock:
        v.pool.oversubscribed["calls_split"] += 1
    subs = [_sub_call(args, kwargs, g) for g in v.groups]

    def one(sub):
        out = _drop_cache(generate_fn(model, *sub[0], **sub[1]))
        with v.pool.lock:
            v.pool.oversubscribed["groups_run"] += 1
        return out

    if v.concurrent == 1:
        outs = [one(sub) for sub in subs]
    else:
        outs = _in_threads(one, subs, v.concurrent, model.device)
    return _assemble(call, outs, v)


def _drop_cache(out):
    """A group's output without its cache, whose blocks go back now: a finished group's KV
    held by its output (return_dict_in_generate) would leave the next group waiting for blocks
    that no live call will free."""
    for name in compat.CACHE_ARGS:
        cache = out.get(name) if not isinstance(out, torch.Tensor) else None
        if isinstance(cache, PagedKVCache):
            cache.reset()
    return out


def _sub_call(args: tuple, kwargs: dict, rows: range) -> tuple[tuple, dict]:
    sl = slice(rows.start, rows.stop)
    args = (args[0][sl], *args[1:]) if args and isinstance(args[0], torch.Tensor) else args
    kw = {k: (v[sl] if k in _PER_ROW and isinstance(v, torch.Tensor) else v)
          for k, v in kwargs.items()}  # fmt: skip
    fn = kw.get("prefix_allowed_tokens_fn")
    if fn is not None:  # it is asked by batch index: the group's rows start at rows.start
        kw["prefix_allowed_tokens_fn"] = lambda b, ids: fn(b + rows.start, ids)
    return args, kw


def _in_threads(fn, subs: list, workers: int, device: torch.device) -> list:
    """fn(sub) for each sub, `workers` at a time, each thread in a copy of the caller's
    context and on the caller's CUDA stream (the inputs were made on it) and inference mode."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    inference = torch.is_inference_mode_enabled()

    def as_caller(sub):
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            if inference:
                stack.enter_context(torch.inference_mode())
            return fn(sub)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="oxygen-group") as ex:
        futures = [ex.submit(contextvars.copy_context().run, as_caller, sub) for sub in subs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()  # groups not started yet do not start
            raise failed[0].exception()
    return [f.result() for f in futures]


def _assemble(call, outs: list, v: Verdict):
    """The groups' outputs as the one call's."""
    seqs = [getattr(o, "sequences", o) for o in outs]
    width = max(s.shape[1] for s in seqs)
    if any(s.shape[1] < width for s in seqs):
        pad = _pad_id(call)
        seqs = [torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad) for s in seqs]
    sequences = torch.cat(seqs, 0)
    if isinstance(outs[0], torch.Tensor):
        return sequences
    fields = {"sequences": sequences}  # the cache is left None: the groups' are not one
    for name in outs[0].keys():
        if name == "beam_indices":
            fields[name] = _beam_indices(outs, v, call.opt("num_beams") or 1)
        elif name not in fields and name not in compat.CACHE_ARGS:
            raise NotImplementedError(
                f"oxygen_torch: generate() output field {name!r} of a call run in row groups "
                "(kv.oversubscribe) cannot be put together: lower the batch or raise "
                "kv.arena_bytes"
            )
    return type(outs[0])(**fields)


def _beam_indices(outs: list, v: Verdict, beams: int) -> torch.Tensor:
    """Each group's beam indices (flat over its rows x beams) shifted to the full batch's rows,
    padded with -1 (as generate() pads a shorter beam) to the longest."""
    parts = [o.beam_indices for o in outs]
    steps = max(p.shape[1] for p in parts)
    got = []
    for p, g in zip(parts, v.groups):
        p = torch.where(p >= 0, p + g.start * beams, p)
        got.append(torch.nn.functional.pad(p, (0, steps - p.shape[1]), value=-1))
    return torch.cat(got, 0)


def _pad_id(call) -> int:
    pad = call.opt("pad_token_id")
    if pad is None:
        eos = call.opt("eos_token_id")
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None:
        raise ValueError(
            "oxygen_torch: the row groups of this generate() (kv.oversubscribe) stopped at "
            "different lengths and there is no pad_token_id (nor eos_token_id) to pad them "
            "with: pass pad_token_id"
        )
    return int(pad.item() if isinstance(pad, torch.Tensor) else pad)
