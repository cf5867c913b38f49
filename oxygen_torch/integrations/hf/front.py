"""generate()'s front door to the engine: a call the engine supports becomes engine requests.

The call's settings are resolved exactly as transformers resolves them (its own helpers: the
model's generation config under the call's, special tokens, max/min lengths), then checked
against what the engine does: greedy and sampling (temperature, top_k, top_p, min_p),
repetition_penalty, min/max length, EOS ids, stop_strings, left padding, num_return_sequences,
streamers, output_scores / output_logits. A call with anything else runs on the per-call path
(transformers' own loop on the paged cache); `reason()` says why, counted in engine_stats().

The caller's thread waits for its rows and runs its streamer (stock's calls: the prompt first,
then one column of new tokens a step, then end()); the output is stock's: the prompt (its
padding kept) and the new tokens, rows that ended early padded with pad_token_id. A streamer
whose `oxygen_engine_thread` is true and that has `oxygen_put_ids` (the server's engine process:
it only hands ids to another thread, and never raises) is called on the engine's thread at each
delivery instead, and its caller woken only at the end: no thread wake a call and step.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections import Counter, OrderedDict

import torch

from ... import _patching
from ...engine import door
from ...engine.request import Group, Request, StopRule
from ...engine.sampling import SamplingParams
from ...engine.task import current as current_task
from ...kv import engine_streams as streams
from ...kv.transfer import int64, to_device
from ...triton_kernels._checks import SUPPORTED_HEAD_DIMS
from . import compat
from . import generate as gen

log = logging.getLogger("oxygen_torch")

# generate() arguments the engine takes; any other (beyond generation-config fields) -> per call
_TAKEN = frozenset({"inputs", "input_ids", "attention_mask", "generation_config", "streamer",
                    "tokenizer", "use_cache", "return_dict_in_generate", "output_scores",
                    "output_logits", "prefill_chunk_size", "synced_gpus"})  # fmt: skip
# generation-config fields and the value under which the engine leaves them alone
_OFF = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "penalty_alpha": (None,),
    "dola_layers": (None,), "assistant_early_exit": (None,), "prompt_lookup_num_tokens": (None,),
    "constraints": (None,), "force_words_ids": (None,), "guidance_scale": (None, 1, 1.0),
    "sequence_bias": (None,), "bad_words_ids": (None,), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "encoder_repetition_penalty": (None, 1.0),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "top_h": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False), "watermarking_config": (None,),
    "output_attentions": (None, False), "output_hidden_states": (None, False),
    "max_time": (None,), "token_healing": (None, False), "low_memory": (None, False),
    "diversity_penalty": (None, 0.0), "use_cache": (None, True),
    "cache_implementation": (None, "dynamic"), "compile_config": (None,),
    "continuous_batching_config": (None,), "use_mtp": (None, False),
}  # fmt: skip

# a waiting caller looks again this often without a delivery (a delivery, an error or the
# engine's end wakes it at once; Ctrl-C interrupts the wait): hundreds of callers waking 10
# times a second took the interpreter lock from the engine thread often enough to slow its
# steps 2.5x on the H200
WAIT_S = 2.0
REASONS: Counter = Counter()  # calls sent to the per-call path, by reason
_reasons_lock = threading.Lock()
_told: set[str] = set()


def note_reason(reason: str) -> None:
    with _reasons_lock:
        REASONS[reason] += 1
        first = reason not in _told
        _told.add(reason)
    if first:
        log.info("oxygen_torch: a generate() call runs on the per-call path: %s", reason)


class Plan:
    """A supported call, resolved: its rows and what its output needs."""

    def __init__(self, ids, gc, requests: list[Request], pad: int, streamer, host_ids):
        self.ids, self.gc, self.requests = ids, gc, requests
        self.pad, self.streamer = pad, streamer
        self.host_ids = host_ids  # ids on the host (the streamer's first put)


def plan(model, args: tuple, kwargs: dict, call=None, host=None, text=None) -> Plan | str:
    """The call's engine requests, or the reason it runs on the per-call path. `call`: the
    call's generate._Call (what it asks of its model: a cache of its own, use_cache=False...),
    made here when not given. `host`: read_inputs(call), when read already. `text`: the model's
    text config, when the caller has it."""
    if len(args) > 1:
        return "positional arguments after the inputs"
    if compat.cache_arg(type(model)) is None:
        return f"{type(model).__name__}.forward takes no cache argument oxygen knows"
    call = call if call is not None else gen._Call(model, args, kwargs)
    if compat.given_cache(kwargs) is not None:
        return "a cache passed in"
    stock = gen._stock_reason(model, call)
    if stock is not None:
        return stock
    text = text if text is not None else model.config.get_text_config(decoder=True)
    device = model.device  # (a walk over the model's parameters: once)
    if device.type == "cuda" and compat.head_dim(text) not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {compat.head_dim(text)} (no kernel)"
    if model._forward_hooks or model._forward_pre_hooks:
        return "forward hooks on the model"
    if model.__dict__.get("forward") is not None or model.__dict__.get("_compiled_call_impl"):
        return "a forward replaced or compiled on the model instance"
    extra = sorted(k for k in kwargs if k not in _TAKEN and not _is_gc_field(k))
    if extra:
        return f"arguments {', '.join(extra)}"
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.dtype not in (torch.long, torch.int)
    ):
        return "inputs other than a 2-D tensor of token ids"
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return "empty inputs"
    if ids.device != device:
        return f"inputs on {ids.device}, the model on {device}"
    mask = kwargs.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "an attention_mask other than a tensor"
    if mask is not None and mask.shape != ids.shape:
        return f"an attention_mask of shape {list(mask.shape)} for inputs {list(ids.shape)}"
    if host is not None and host[0].shape == ids.shape:
        host_ids, host_mask = host
    else:
        host_ids, host_mask = _to_host(ids, mask)  # (a device read: outside the door)
    with door.caller(ids.device, current_task().level):  # (not during a launch: engine/door.py)
        try:
            gc, host_mask = _resolve(model, host_ids, host_mask, kwargs)
        except Exception as err:  # noqa: BLE001 - stock raises it again on the per-call path
            return f"settings transformers refuses ({type(err).__name__})"
        if isinstance(gc, str):
            return gc
        why = _unsupported(gc)
        if why is not None:
            return why
        return _requests(ids, host_ids, host_mask, gc, kwargs)


def read_inputs(call):
    """(ids, mask) of a call on the host, read in one copy; None for inputs other than a 2-D
    tensor of token ids (with a mask of its shape, or none)."""
    ids, mask = call.inputs, call.kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (
        torch.long, torch.int
    ):  # fmt: skip
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        return None
    return _to_host(ids, mask)


def _to_host(ids: torch.Tensor, mask: torch.Tensor | None):
    """The call's ids and mask on the host, read from the device in one copy: each read waits
    for the work queued on the caller's stream, the engine's steps among it (one wait, not
    one per tensor and per special token as stock's preparation on the device costs)."""
    if ids.device.type == "cpu" or mask is None or mask.device.type == "cpu":
        return ids.cpu(), None if mask is None else mask.cpu()  # (a host tensor: itself)
    both = torch.stack((ids.long(), mask.to(device=ids.device, dtype=torch.long))).cpu()
    return both[0].to(ids.dtype), both[1].to(mask.dtype)


_gc_proto = None  # a default GenerationConfig: which names are its fields


def _is_gc_field(name: str) -> bool:
    global _gc_proto
    if _gc_proto is None:
        from transformers import GenerationConfig

        _gc_proto = GenerationConfig()
    return hasattr(_gc_proto, name) or name in _OFF


def _resolve(model, ids: torch.Tensor, mask: torch.Tensor | None, kwargs: dict):
    """(the call's generation config as stock resolves it, its attention mask) or a reason.
    ids, mask: the call's, on the host (the config's special-token tensors are made there)."""
    prepare = _patching.require(
        model, "_prepare_generation_config", library="transformers",
        what="generate() calls run on the per-call path",
    )  # fmt: skip
    special = _patching.require(
        model, "_prepare_special_tokens", library="transformers",
        what="generate() calls run on the per-call path",
    )  # fmt: skip
    lengths = getattr(model, "_prepare_generated_length", None)
    if prepare is None or special is None or lengths is None:
        return "a transformers layout oxygen does not know", None
    given = kwargs.get("generation_config")
    gen_kw = {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids",
              "generation_config", "streamer", "tokenizer", "synced_gpus")}  # fmt: skip
    default_max = (
        kwargs.get("max_length") is None
        and (given is None or given.max_length is None)
        and model.generation_config.max_length is None
    )
    default_min = (
        kwargs.get("min_length") is None
        and (given is None or given.min_length is None)
        and model.generation_config.min_length is None
    )
    if "attention_mask" in gen_kw:
        gen_kw["attention_mask"] = mask
    gc, model_kw = _prepare(model, prepare, given, gen_kw)
    model_kw.pop("prefill_chunk_size", None)
    mask = model_kw.pop("attention_mask", None)
    model_kw.pop("use_cache", None)
    if model_kw:
        return f"model arguments {', '.join(sorted(model_kw))}", None
    special(gc, mask is not None, device=ids.device, batch_size=ids.shape[0])
    if mask is None:
        mask = _default_mask(ids, gc)
    n = max(gc.num_return_sequences or 1, 1)
    lengths(gc, default_max, default_min, "input_ids", ids.shape[1], ids)
    if getattr(model, "_validate_generated_length", None) is not None:
        model._validate_generated_length(gc, ids.shape[1], default_max)
    gc._oxygen_expand = n
    return gc, mask


# --- stock's _prepare_generation_config, memoised --------------------------------------------
# It costs 1.5-2.5 ms a call on transformers 5.17 (its check that the model's config holds no
# generation parameters builds a default config of the model's class each time): hundreds of
# threads calling generate() at once spent that under the interpreter lock while the engine
# thread launched a step (a 1-row prefill step took 1.1-1.7 s on the H200 at 256 calls). Its
# result depends only on the state of the model's config (that check), of the model's
# generation config, of the given one and on the keyword arguments: keyed by all of them, a
# call with the same settings copies the first call's result instead.

_PLAIN = (type(None), bool, int, float, str)
_MEMO_SIZE = 32  # settings remembered per model (least recently used go first)
_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict
_memo_lock = threading.Lock()


_LENGTHS = ("max_new_tokens", "min_new_tokens")


def _a_length(name: str, v) -> bool:
    """Whether `v` is a value stock's resolution would take for `name` with no check failing."""
    if type(v) is not int:
        return False
    return v > 0 if name == "max_new_tokens" else v >= 0


def _plain(v) -> bool:
    if isinstance(v, _PLAIN):
        return True
    return isinstance(v, (list, tuple)) and all(_plain(x) for x in v)


_SCALAR_TYPES = frozenset((type(None), bool, int, float, str))


_states: dict[int, tuple] = {}  # id(object) -> what _state last found (see there)
_STATES_SIZE = 64


def _state(obj) -> tuple:
    """What an object's attributes hold, as a key: scalars as themselves with their type (no
    repr: most of a config's ~60 attributes), nested configs by their own attributes (a
    composite config's repr serialises it to JSON: 4.5 ms for Gemma3's), others by repr.

    The last key of each object is kept beside its attributes' values and types: when the
    object holds the same ones again (compared in C: the same objects, or equal ones of the
    same types) and its other values (lists, dicts, nested configs: changed in place or not)
    give the same parts again, that key is the answer, in a fifth of the time."""
    attrs = vars(obj)
    values = tuple(attrs.values())
    types = tuple(map(type, values))
    hit = _states.get(id(obj))
    if hit is not None:
        ref, names, old_values, old_types, parts, key = hit
        try:
            same = (
                ref() is obj and old_types == types and old_values == values
                and names == tuple(attrs)
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - a value whose == is not a truth value (a tensor)
            same = False
        if same and all(_part(values[i]) == p for i, p in parts):
            return key
    key, parts = _state_of(attrs)
    try:
        ref = weakref.ref(obj)
    except TypeError:  # (an object weak references cannot name: not kept)
        return key
    if len(_states) >= _STATES_SIZE:
        _states.clear()
    _states[id(obj)] = (ref, tuple(attrs), values, types, parts, key)
    return key


def _part(v):
    from transformers import PretrainedConfig

    return _state(v) if isinstance(v, PretrainedConfig) else repr(v)


def _state_of(attrs: dict) -> tuple[tuple, tuple]:
    """(the key of these attributes, [(position, part)] of their values other than scalars)."""
    out, parts = [], []
    for i, (k, v) in enumerate(attrs.items()):
        t = type(v)
        if t in _SCALAR_TYPES:
            out.append((k, t, v))
        else:
            part = _part(v)
            parts.append((i, part))
            out.append((k, part))
    out.sort(key=lambda x: x[0])
    return tuple(out), tuple(parts)


class _Kept:
    """A resolved generation config the memo keeps (never handed out: _copy makes the calls'
    own), with the names of its attributes other than scalars."""

    __slots__ = ("gc", "deep")

    def __init__(self, gc):
        self.gc = _copy(gc)
        self.deep = tuple(k for k, v in vars(self.gc).items() if type(v) not in _SCALAR_TYPES)


def _copy(gc):
    """copy.deepcopy(gc), in a fifth of its time: a generation config's attributes are mostly
    plain values, shared; the others (lists, dicts, objects) are deep-copied. A _Kept one: its
    scalars in one update, the others (named there) deep-copied."""
    if isinstance(gc, _Kept):
        kept, cls = gc.gc, type(gc.gc)
        if hasattr(cls, "__deepcopy__") or hasattr(cls, "__setstate__"):
            return copy.deepcopy(kept)
        new = cls.__new__(cls)
        attrs = new.__dict__
        attrs.update(kept.__dict__)
        for k in gc.deep:
            attrs[k] = copy.deepcopy(attrs[k])
        return new
    cls = type(gc)
    if hasattr(cls, "__deepcopy__") or hasattr(cls, "__setstate__"):
        return copy.deepcopy(gc)
    new = cls.__new__(cls)
    new.__dict__.update(
        {k: v if isinstance(v, _PLAIN) else copy.deepcopy(v) for k, v in vars(gc).items()}
    )
    return new


def _prepare(model, prepare, given, gen_kw: dict):
    """prepare(given, **gen_kw) (stock's _prepare_generation_config: (a generation config, the
    model keyword arguments)), from the memo when the same state was resolved before. Keyword
    values other than plain values (an attention mask) are model arguments: they join the
    result as given; a call with any other non-plain value is resolved afresh."""
    mask = gen_kw.get("attention_mask")
    rest = {k: v for k, v in gen_kw.items() if k != "attention_mask"}
    if not all(_plain(v) for v in rest.values()) or not (mask is None or torch.is_tensor(mask)):
        return prepare(given, **gen_kw)
    # The lengths a call asks for are set on the remembered settings' copy, not in the key:
    # a server's or a trace's calls each ask for their own length, and every distinct length
    # was a miss (stock's resolution: ~1 ms of deep copies under the interpreter lock, 7 % of
    # the callers' share of it on the loaded H100 trace). Stock only sets them and checks
    # max_new_tokens > 0: lengths that would fail that check take stock's path.
    lengths = {k: rest.pop(k) for k in _LENGTHS if k in rest}
    if not all(_a_length(k, v) for k, v in lengths.items()):
        return prepare(given, **gen_kw)
    try:
        key = (
            _state(model.config) if given is None else None,
            _state(model.generation_config),
            None if given is None else _state(given),
            repr(sorted(rest.items())),
            tuple(lengths),  # (which lengths the call sets: their values are not in the key)
            "attention_mask" in gen_kw,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - an attribute without a usable repr: not memoised
        return prepare(given, **gen_kw)
    with _memo_lock:
        memo = _memo.get(model)
        hit = memo.get(key) if memo is not None else None
        if hit is not None:
            memo.move_to_end(key)
    if hit is None:
        gc, model_kw = prepare(given, **gen_kw)  # (with its lengths: set on the kept copy too)
        with _memo_lock:
            memo = _memo.setdefault(model, OrderedDict())
            memo[key] = (_Kept(gc), {k: v for k, v in model_kw.items()
                                             if k != "attention_mask"})  # fmt: skip
            while len(memo) > _MEMO_SIZE:
                memo.popitem(last=False)
        return gc, model_kw
    gc, model_kw = _copy(hit[0]), dict(hit[1])
    for k, v in lengths.items():
        setattr(gc, k, v)
    if "attention_mask" in gen_kw:
        model_kw["attention_mask"] = mask
    return gc, model_kw


def _default_mask(ids: torch.Tensor, gc) -> torch.Tensor:
    """Stock's mask when none is given: padding inferred where pad differs from every EOS."""
    pad, eos = gc._pad_token_tensor, gc._eos_token_tensor
    if pad is None:
        return torch.ones_like(ids)
    infer = bool(torch.isin(ids, pad).any()) and (
        eos is None or not bool(torch.isin(eos, pad).any())
    )
    return ids.ne(pad).long() if infer else torch.ones_like(ids)


def _unsupported(gc) -> str | None:
    for name, off in _OFF.items():
        value = getattr(gc, name, None)
        if value not in off and not (isinstance(value, (list, tuple)) and not value):
            return f"{name}={value!r}"
    if gc.num_return_sequences and gc.num_return_sequences > 1 and not gc.do_sample:
        return "num_return_sequences without sampling"
    return None


def _requests(ids: torch.Tensor, host_ids, host_mask, gc, kwargs: dict) -> Plan | str:
    """ids: the call's as given (the output starts with them); host_ids / host_mask: on the
    host."""
    # (numpy: a call's few small host ops, ~10x cheaper than torch's)
    if host_mask.dtype not in (torch.bool, torch.long, torch.int):
        host_mask = host_mask.to(torch.bool)  # (a float mask: numpy may not hold its dtype)
    real = host_mask.numpy().astype(bool, copy=False)
    full = bool(real.all())  # (no padding: the checks below have nothing to find)
    if not full and bool((real[:, :-1] & ~real[:, 1:]).any()):
        return "padding after real tokens (right padding or holes)"
    if not full and not bool(real.any(axis=1).all()):
        return "a row with no real token"
    n = gc._oxygen_expand
    eos = (
        ()
        if gc._eos_token_tensor is None
        else tuple(int(t) for t in gc._eos_token_tensor.flatten())
    )
    pad = int(gc._pad_token_tensor) if gc._pad_token_tensor is not None else 0
    width = ids.shape[1]
    stop = StopRule(
        max_new=gc.max_length - width, eos=eos, min_new=max(0, (gc.min_length or 0) - width),
        strings=_stop_strings(gc), text_of=_stop_check(gc, kwargs),
    )  # fmt: skip
    if stop.strings and stop.text_of is None:
        return "stop_strings without a tokenizer"
    task = current_task()
    settings = _sampling(gc)
    if isinstance(settings, str):
        return settings
    # the ids the repetition penalty starts from: the row as given, or without its left padding
    penalised = [None] * ids.shape[0]
    if settings["repetition_penalty"] != 1.0:
        keep = torch.from_numpy(real)
        penalised = [host_ids[b][keep[b]] if compat.penalty_skips_padding() else host_ids[b]
                     for b in range(ids.shape[0])]  # fmt: skip
    rows_np = host_ids.numpy()
    base = _call_seed()  # (last: a call sent to the per-call path draws nothing from the RNG)
    requests = []
    for b in range(ids.shape[0]):
        prompt = rows_np[b].tolist() if full else rows_np[b][real[b]].tolist()
        for k in range(n):
            seed = (base + 0x9E3779B9 * (b * n + k)) & ((1 << 63) - 1)
            params = SamplingParams(**settings, seed=seed)
            requests.append(
                Request(
                    prompt,
                    params,
                    stop,
                    task,
                    keep_scores=bool(gc.output_scores),
                    keep_logits=bool(gc.output_logits),
                    penalty_ids=penalised[b],
                    keep_kv=bool(gc.return_dict_in_generate),
                    pad_id=pad,
                    lockstep=bool(gc.output_scores or gc.output_logits) and ids.shape[0] * n > 1,
                )  # fmt: skip
            )
    rows = ids.repeat_interleave(n, dim=0) if n > 1 else ids
    p = Plan(rows, gc, requests, pad, kwargs.get("streamer"),
             host_ids.repeat_interleave(n, dim=0) if n > 1 else host_ids)  # fmt: skip
    p.padded = not full
    return p


def _sampling(gc) -> dict | str:
    """The call's sampling settings (None in the config: the processor is off), or, for values
    transformers refuses (temperature 0 with sampling, a penalty <= 0...), the reason: the
    per-call path gives stock's own error."""

    def given(name, off):
        value = getattr(gc, name, None)
        return off if value is None else value

    settings = dict(
        do_sample=bool(gc.do_sample), temperature=float(given("temperature", 1.0)),
        top_k=int(given("top_k", 0)), top_p=float(given("top_p", 1.0)), min_p=gc.min_p,
        repetition_penalty=float(given("repetition_penalty", 1.0)),
    )  # fmt: skip
    try:
        SamplingParams(**settings)
    except ValueError as err:  # (the field only: a bounded set of reasons)
        return f"a {str(err).split(':')[0]} transformers refuses"
    return settings


def _stop_strings(gc) -> tuple[str, ...]:
    s = gc.stop_strings
    if s is None:
        return ()
    return (s,) if isinstance(s, str) else tuple(s)


def _stop_check(gc, kwargs: dict):
    """stop_strings as stock checks them (its StopStringCriteria, on the row's tail only)."""
    strings = _stop_strings(gc)
    tok = kwargs.get("tokenizer")
    if not strings or tok is None:
        return None
    crit = _criteria(tok, strings)
    tail = max(int(getattr(crit, "maximum_token_len", 0)) or 0, 1) + max(map(len, strings)) + 1

    def check(seq: list[int]) -> bool:
        return bool(crit(torch.tensor([seq[-tail:]]), None)[0])

    return check


_criteria_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {...}
_criteria_lock = threading.Lock()


def _criteria(tok, strings: tuple[str, ...]):
    """transformers' StopStringCriteria for these strings, made once per tokenizer (it reads
    the whole vocabulary: 128k tokens for a Llama-3 tokenizer, every call otherwise)."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    with _criteria_lock:
        made = _criteria_cache.setdefault(tok, {})
        crit = made.get(strings)
    if crit is None:
        crit = StopStringCriteria(stop_strings=strings, tokenizer=tok)
        with _criteria_lock:
            if len(made) >= 64:  # (a bound: a server may see many stop sets)
                made.clear()
            made[strings] = crit
    return crit


def _call_seed() -> int:
    """The call's seed: from the task when it names one, else drawn from torch's global RNG (a
    call after torch.manual_seed draws the same tokens again)."""
    seed = getattr(current_task(), "seed", None)
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 1 << 62, (1,)).item())


# --- the caller's side ------------------------------------------------------------------------


def run(engine, p: Plan, entered: float | None = None, arrival=None):
    """Submits the call's rows, waits (streaming in this thread), returns stock's output.
    entered: perf_counter time of the generate() call (the engine counts the door's time);
    arrival: the call's count in door.coming, left once its rows are submitted."""
    _check_lockstep(engine, p)
    streamer = p.streamer
    if streamer is not None:  # (the user's code: outside the door)
        streamer.put(p.host_ids)
    # (no door: a resolved call's rows go to the engine at once, engine/door.py)
    group = Group(p.requests, streaming=streamer is not None, cancel=current_task().cancel)
    group.entered = entered
    sink = _EngineSink.of(streamer, group, p.pad)  # (before the engine can deliver)
    engine.submit(group)
    if arrival is not None:
        arrival.leave()
    sent = 0
    try:
        seen = 0
        while True:
            seen = group.wait(seen, WAIT_S)
            if streamer is not None and sink is None:
                sent = _stream(streamer, group, p.pad, sent)
            if group.done:
                break
    except BaseException:
        engine.cancel(group)
        _release(group)
        raise
    if group.error is not None:
        _release(group)
        raise group.error
    if sink is not None:
        sink.final()
    elif streamer is not None:
        _stream(streamer, group, p.pad, sent, final=True)
    if streamer is not None:
        streamer.end()
    try:
        return _output(p, group, engine.runner)
    finally:
        _release(group)


def _release(group: Group) -> None:
    """KV rows the engine handed over and no cache took give their blocks back."""
    kvs = [r.kv for r in group.requests if r.kv is not None and r.kv.pool is not None]
    if kvs:  # (their pages are retired behind this thread's stream: after the engine's steps)
        streams.after_engines(kvs[0].pool.key.device)
    for r in group.requests:
        if r.keep_kv and r.kv is not None and r.finished in ("eos", "length", "stop"):
            r.kv.release()
            r.kv = None


def _check_lockstep(engine, p: Plan) -> None:
    """A call that keeps scores or logits steps all its rows until its last ends (as stock's
    batch): they must fit the KV pool together, or it could never end."""
    rows = [r for r in p.requests if r.lockstep]
    if not rows:
        return
    kvs = engine.kvs
    need = sum(kvs.blocks_for(None, len(r.prompt) + r.stop.max_new) for r in rows)
    if need > kvs.total_blocks():
        asked = [n for n in ("output_scores", "output_logits") if getattr(p.gc, n, False)]
        raise ValueError(
            f"oxygen_torch: this generate() keeps {', '.join(asked)}, so its {len(rows)} rows "
            f"step together to the end (as stock's batch does), and together they need up to "
            f"{need} KV blocks; the KV pool holds {kvs.total_blocks()}: lower the batch, "
            f"raise kv.arena_bytes, or leave out {', '.join(asked)}"
        )


class _EngineSink:
    """A streamer run on the engine's thread (group.sink): its columns as _stream() makes them,
    under a lock (the caller's final look may come while the engine delivers)."""

    def __init__(self, streamer, group: Group, pad: int):
        self.streamer, self.group, self.pad = streamer, group, pad
        self.sent, self.lock = 0, threading.Lock()

    @classmethod
    def of(cls, streamer, group: Group, pad: int) -> _EngineSink | None:
        if not getattr(streamer, "oxygen_engine_thread", False):
            return None
        if getattr(streamer, "oxygen_put_ids", None) is None:
            return None  # (put() a column at a time is the caller's thread's work)
        sink = cls(streamer, group, pad)
        group.sink = sink.deliver
        return sink

    def deliver(self) -> None:
        with self.lock:
            self.sent = _stream(self.streamer, self.group, self.pad, self.sent)

    def final(self) -> None:
        with self.lock:
            self.sent = _stream(self.streamer, self.group, self.pad, self.sent, final=True)


def _stream(streamer, group: Group, pad: int, sent: int, final: bool = False) -> int:
    """Puts every complete column of new tokens after the `sent` first: column j once every
    row has its token j or has ended (then pad, as stock). A streamer with an `oxygen_put_ids`
    method (the server's jobs) gets them all in one call, each column a list of ints, not a
    tensor a column that it would read back to a list."""
    reqs = group.requests
    live = [len(r.out) for r in reqs if r.finished is None]
    upto = min(live) if live else max(len(r.out) for r in reqs)
    if final:
        upto = max(len(r.out) for r in reqs)
    cols = [[r.out[j] if j < len(r.out) else pad for r in reqs] for j in range(sent, upto)]
    put_ids = getattr(streamer, "oxygen_put_ids", None)
    if put_ids is not None and cols:
        put_ids(cols)
    else:
        for col in cols:  # (through an array's buffer: a third of torch.tensor's CPU)
            streamer.put(int64(col))
    return max(sent, upto)


def _output(p: Plan, group: Group, runner):
    reqs = group.requests
    streams.after_engines(p.ids.device)  # (the cache's blocks, kept scores: kv/engine_streams.py)
    # three ops, not through the door: at 256 calls ending together the door's one-by-one
    # hand-offs (a thread wake each) and a fill, a tensor and a copy a row took the callers
    # 97-116 ms after the last step where one call's output took 16-24 (H200)
    width = max(len(r.out) for r in reqs)
    new = torch.tensor([r.out + [p.pad] * (width - len(r.out)) for r in reqs], dtype=p.ids.dtype)
    seqs = torch.cat([p.host_ids, new], dim=1)
    # (on CUDA from pinned memory: the copy does not wait for the engine's queued steps)
    dev = p.ids.device
    seqs = to_device(seqs, dev) if dev.type == "cuda" else seqs.to(dev)
    gc = p.gc
    if not gc.return_dict_in_generate:
        return seqs
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    def steps(name):
        rows = [getattr(r, name) for r in reqs]
        if not any(rows):
            return None
        return tuple(torch.stack([row[j] for row in rows]) for j in range(width))

    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    name = next(n for n in compat.CACHE_ARGS if n in fields)  # 5.24 renamed it `cache`
    return GenerateDecoderOnlyOutput(
        sequences=seqs,
        scores=steps("scores") if gc.output_scores else None,
        logits=steps("logits") if gc.output_logits else None,
        attentions=None,
        hidden_states=None,
        **{name: _cache(p, reqs, runner, seqs.shape[1] - 1)},
    )


def _cache(p: Plan, reqs: list[Request], runner, length: int):
    """The call's rows' KV as one PagedKVCache of B sequences (stock hands back its cache):
    each row holds its prompt and its new tokens but the last, as stock's cache does. None
    when the engine took a finished row's blocks back for rows of the call still waiting (the
    call's rows did not fit the pool together)."""
    if any(r.kv is None for r in reqs):
        return None
    cache = runner.new_cache()
    cores = [r.kv for r in reqs]
    for r, core in zip(reqs, cores):
        with core.pool.lock:
            core.seqs.truncate(0, len(r.prompt) + len(r.out) - 1)
    cache._core.adopt(cores, length, p.ids.shape[1] if p.padded else 0)
    for r in reqs:
        r.kv = None
    return cache
