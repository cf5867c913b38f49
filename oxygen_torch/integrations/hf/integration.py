"""transformers integration: `enable_hf(cfg)`, `disable_hf()`, `apply(model, cfg)`.

enable_hf registers the "oxygen" attention and mask functions (transformers' public
AttentionInterface / AttentionMaskInterface), makes models created afterwards default to them
(when their architecture is supported), and wraps generate() so that a call that would build a
DynamicCache gets a PagedKVCache instead (generate.py). Every replaced attribute goes through the
patch module (group "transformers"); disable_hf() unwinds it and puts the models it switched
back on SDPA. Each model carries the configuration it was switched with (`apply(model, cfg)`
affects that model only); models created after enable_hf take enable's.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref

from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ... import _patching
from ...config import OxygenConfig, load_config
from ...engine import door, rank_plan
from ...engine.task import current as current_task
from ...kv.pool import release_pools
from . import batched, compat, engine_runner, front, graphs, oversubscribe, router
from . import generate as gen
from .attention import oxygen_attention_forward, oxygen_mask

log = logging.getLogger("oxygen_torch")

NAME = "oxygen"
STOCK = "sdpa"
GROUP = router.GROUP  # "transformers"
# Model families whose attention goes through the interface unchanged (tested in CI: the first
# seven in depth, the others by tests/test_hf_families.py: concurrent calls give stock's tokens).
# Left out on purpose: attention sinks (gpt_oss), latent attention (deepseek_v2/v3: K and V of
# different sizes), linear-attention and convolution hybrids (qwen3_next, granitemoehybrid,
# lfm2), KV shared across layers (gemma3n), models that transform K/V after the cache update
# (jetmoe) and those that bypass the interface (falcon, bloom, mpt: unsupported_reason says so).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
    "apertus", "arcee", "bitnet", "cohere", "cohere2", "ernie4_5", "ernie4_5_moe", "exaone4",
    "glm", "glm4", "glm4_moe", "gpt2", "gpt_neox", "granite", "granitemoe", "helium",
    "ministral", "mixtral", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "opt", "persimmon",
    "phi", "phi3", "phimoe", "qwen2_moe", "qwen3_moe", "seed_oss", "smollm3", "stablelm",
    "starcoder2",
)  # fmt: skip


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.cfg: OxygenConfig | None = None  # enable_hf's: models created afterwards take it
        self.installed = False  # attention registered + generate wrapped
        self.defaulting = False  # new models default to oxygen
        # model -> (its cfg, the attention it had or would have had without oxygen)
        self.models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.generate = None  # transformers' generate, as it was before the wrap
        self.get_correct = None  # transformers' get_correct_attn_implementation, likewise


_state = _State()


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run on oxygen attention, or None when it can."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models (cross-attention)"
    text = cfg.get_text_config(decoder=True)
    mtype = getattr(text, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        return (
            f"model type {mtype!r} (not among oxygen_torch's SUPPORTED_MODEL_TYPES: "
            "docs/generate.md lists the families and why some are left out)"
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(text, "attention_chunk_size", None) is not None:
        return "chunked attention"
    if not type(model)._can_set_attn_implementation():
        return "a model that bypasses the attention interface"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)}"
    return None


def uses_oxygen(model, text=None) -> bool:
    """Whether `model` attends through oxygen. `text`: its text config, when the caller has it
    (get_text_config costs ~20 us through transformers' attribute hooks)."""
    text = text if text is not None else model.config.get_text_config(decoder=True)
    return getattr(text, "_attn_implementation", None) == NAME


def config_of(model) -> OxygenConfig:
    """The configuration `model` was switched with: apply()'s, else enable_hf's, else the
    sources enable() reads (OXYGEN_CONF, the file, the defaults)."""
    cfg = _state.models.get(model, (_state.cfg, None))[0]
    return cfg if cfg is not None else load_config()


# --- what replaces transformers' own ---------------------------------------------------------


def _get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
    """New models (no attn_implementation asked) default to oxygen when supported."""
    if requested_attention is None and _state.defaulting:
        reason = unsupported_reason(self)
        if reason is None:
            stock = _state.get_correct(self, None, is_init_check)  # what disable() puts back
            _state.models[self] = (_state.cfg, stock)
            requested_attention = NAME
        else:
            _patching.warn_once(
                f"oxygen_torch: {type(self).__name__} keeps stock attention: {reason} "
                "is not supported"
            )
    return _state.get_correct(self, requested_attention, is_init_check)


def _generate(self, *args, **kwargs):
    """generate() on oxygen's paged cache where it would run on a DynamicCache (generate.py)."""
    entered = time.perf_counter()
    text = self.config.get_text_config(decoder=True)  # (once a call: each look costs ~20 us)
    if not uses_oxygen(self, text):
        _not_on_oxygen(self)
        return _state.generate(self, *args, **kwargs)
    router.ensure(self)
    cfg = config_of(self)
    tp = rank_plan.tp_size(self) > 1
    merged = cfg.scheduler.merge and (not tp or _coordinated(self))
    # (tensor parallel: row groups one after another, the same on every rank)
    engine = merged and not tp and cfg.scheduler.engine
    # an idle engine waits for the calls on their way in (engine/door.py, `coming`)
    arrival = door.arrive(self.device) if engine else None
    try:
        call = gen._Call(self, args, kwargs)
        # the engine's calls read their inputs to the host once (each read waits for the steps
        # queued on the stream), and the checks below use that copy
        host = front.read_inputs(call) if engine else None
        gen.validate(self, call, host[0] if host else None)  # before the call shares a step
        if engine:
            p = front.plan(self, args, kwargs, call, host, text)
            if not isinstance(p, str):
                eng = engine_runner.engine_for(self, cfg, text)
                return front.run(eng, p, entered, arrival)
            front.note_reason(p)
    finally:
        if arrival is not None:
            arrival.leave()
    verdict = oversubscribe.judge(self, cfg, call, merged and not tp)  # None: rows fit
    if verdict is not None and verdict.groups is not None:
        return oversubscribe.run(self, verdict, args, kwargs, _generate)
    kwargs, cache = gen.plan(self, cfg, call)
    try:
        if cache is not None and merged:
            return _merged(self, cache, args, kwargs)
        out = _state.generate(self, *args, **kwargs)
    except oversubscribe.KV_ERRORS as err:
        if verdict is None:
            raise
        raise verdict.explain(err) from err
    gen.check_used(self, cache)
    gen.finish(cache, out)
    return out


def _merged(model, cache, args: tuple, kwargs: dict):
    """generate() registered with the model's step scheduler (concurrent calls' steps merged).
    The cache's blocks go back before the call leaves it, unless the output holds the cache: a
    call left alone runs its forwards by itself, without preemption, and must not find blocks
    held by a call that has finished (under load its thread can take a while to drop them)."""
    out = None
    with batched.session(model, cache, current_task()):
        try:
            out = _state.generate(model, *args, **kwargs)
            gen.check_used(model, cache)
            gen.finish(cache, out)
        finally:
            if not _holds(out, cache):
                cache._core.release()
    return out


def _holds(out, cache) -> bool:
    """Whether generate()'s output hands `cache` to the caller (return_dict_in_generate: as its
    cache, or as the self-attention part of one)."""
    pkv = _output_cache(out)
    return pkv is not None and (pkv is cache or getattr(pkv, "self_attention_cache", None) is cache)


def _output_cache(out):
    """The cache generate()'s output carries, read under the field its class has: 5.24 renamed
    `past_key_values` to `cache`, and logs a deprecation warning when the old name is read
    (as an attribute, a key or by get()); stock generate() reads nothing, so neither may we."""
    fields = getattr(out, "__dataclass_fields__", None) or {}
    name = next((n for n in compat.CACHE_ARGS if n in fields), None)
    return getattr(out, name, None) if name is not None else None


def _coordinated(model) -> bool:
    """Whether the calls of a tensor-parallel model are merged, in steps rank 0 chooses for every
    rank (engine/rank_plan.py); when they cannot be, they run one by one, with one warning."""
    reason = rank_plan.unsupported(model)
    if reason is None:
        return True
    _patching.warn_once(
        f"oxygen_torch: {type(model).__name__} is tensor-parallel and its generate() calls run "
        f"one by one, not merged ({reason}); issue them in the same order on every rank"
    )
    return False


def _not_on_oxygen(model) -> None:
    """A supported model that generates on stock attention while oxygen is on: say so once."""
    if not _state.defaulting or unsupported_reason(model) is not None:
        return
    impl = model.config.get_text_config(decoder=True)._attn_implementation
    _patching.warn_once(
        f"oxygen_torch: {type(model).__name__} runs generate() on {impl!r} attention, not "
        "oxygen's (it was created before oxygen_torch.enable(), asked for it, or shares a config "
        "that an earlier model set): the paged KV cache and oxygen's kernels are not used; "
        "oxygen_torch.apply(model) switches it"
    )


def _install() -> None:
    """Registers the attention + mask functions and wraps generate() (idempotent)."""
    with _state.lock:
        if _state.installed:
            return
        for iface, fn in (
            (AttentionInterface, oxygen_attention_forward),
            (AttentionMaskInterface, oxygen_mask),
        ):
            mapping = _patching.require(
                iface, "_global_mapping", library="transformers",
                what=f"{iface.__name__}.register is used without a way to undo it",
            )  # fmt: skip
            if isinstance(mapping, dict):
                _patching.register(mapping, NAME, fn, why="the oxygen attention", group=GROUP)
            else:
                iface.register(NAME, fn)
        _state.generate = GenerationMixin.generate
        _patching.replace(
            GenerationMixin, "generate", functools.wraps(_state.generate)(_generate),
            why="generate() on the paged cache where it would build a DynamicCache",
            group=GROUP,
        )  # fmt: skip
        _state.installed = True


# --- public ----------------------------------------------------------------------------------


def is_enabled() -> bool:
    """Whether enable_hf() is in force (new models default to oxygen attention)."""
    return _state.defaulting


def enable_hf(cfg: OxygenConfig | None = None) -> None:
    """Switch the transformers integration on (see the module docstring)."""
    with _state.lock:
        _state.cfg = cfg if cfg is not None else load_config()
        _install()
        if _state.defaulting:
            return
        getter = _patching.require(
            PreTrainedModel, "get_correct_attn_implementation", library="transformers",
            what="models created after enable() keep their attention; use oxygen_torch.apply()",
        )  # fmt: skip
        if getter is not None:
            _state.get_correct = getter
            _patching.replace(
                PreTrainedModel, "get_correct_attn_implementation",
                _get_correct_attn_implementation,
                why="new models default to the oxygen attention", group=GROUP,
            )  # fmt: skip
            _state.defaulting = True


def apply(model, cfg: OxygenConfig | None = None):
    """Switch an existing model to oxygen attention (and paged KV in generate); returns it.
    `cfg` (default: enable_hf's, else load_config()) applies to this model only.

    An unsupported model is left as it is, with one warning naming what is unsupported."""
    with _state.lock:
        _install()
        reason = unsupported_reason(model)
        if reason is not None:
            _patching.warn_once(
                f"oxygen_torch: {type(model).__name__} keeps stock attention: {reason} "
                "is not supported"
            )
            return model
        before = _state.models.get(model, (None, None))[1]
        if before is None:
            before = model.config.get_text_config(decoder=True)._attn_implementation
        model.set_attn_implementation(NAME)
        _state.models[model] = (cfg if cfg is not None else (_state.cfg or load_config()), before)
        router.ensure(model)
    return model


def disable_hf() -> None:
    """Restore stock transformers: models switched to oxygen go back to SDPA."""
    router.note_disable()  # forwards running on the paged cache now fail clearly
    with _state.lock:
        for model, (_, before) in list(_state.models.items()):
            if uses_oxygen(model):
                model.set_attn_implementation(before if before not in (None, NAME) else STOCK)
        _state.models.clear()
        _patching.undo(GROUP)
        _state.installed = _state.defaulting = False
        # (generate and get_correct stay: a call, or a model's creation, that entered the
        # wrap before the undo ends on them)
        _state.cfg = None
        engine_runner.close_all()  # calls still waiting get a clear error
        graphs.clear()  # graphs read the pools' memory
        batched.clear_graphs()
        release_pools()  # pools still holding a live cache's blocks stay
