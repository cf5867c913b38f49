"""The model side of the server: prompts to token ids, the limits a request must fit, and the
generate() call a checked request becomes. What it needs of the model is a few facts
(`ModelFacts`): the model itself may live in another process (engine_process.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .jobs import Call
from .protocol import ApiError, Request, bad
from .text import ChoiceText


def _eos_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else (int(e) for e in eos))


@dataclass(frozen=True)
class ModelFacts:
    """What the endpoints need to know of the model (picklable: sent by the engine process)."""

    max_positions: int | None  # max_position_embeddings (None: the config does not say)
    vocab: int
    eos: frozenset[int]
    pad: int
    device: str


def model_facts(model, tokenizer) -> ModelFacts:
    """The model's facts; sets its generation config's pad id when it has none (from the
    tokenizer, else an EOS id: stock warns at every call otherwise)."""
    cfg = model.config
    known = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    eos = _eos_ids(model)
    gc = model.generation_config
    if gc.pad_token_id is None:
        pad = getattr(tokenizer, "pad_token_id", None)
        gc.pad_token_id = pad if pad is not None else min(eos, default=0)
    return ModelFacts(int(known) if known else None, int(cfg.get_text_config().vocab_size), eos,
                      int(gc.pad_token_id), str(model.device))  # fmt: skip


def local_kv_tokens(device: str) -> int | None:
    """Tokens one row may hold in this process's KV pool on `device` (None until it exists)."""
    import oxygen_torch

    pools = [p for p in oxygen_torch.kv_stats() if p.get("device") == device]
    return max(p["blocks_total"] * p["block_tokens"] for p in pools) if pools else None


class Served:
    """A model and its tokenizer as the endpoints see them: the model's facts, and where the
    KV pool's size is read (`kv_tokens`: None until the pool exists)."""

    def __init__(self, facts: ModelFacts, tokenizer, max_model_len: int | None = None,
                 kv_tokens: Callable[[], int | None] | None = None):  # fmt: skip
        self.facts, self.tok = facts, tokenizer
        self.max_model_len = int(max_model_len or facts.max_positions or 2048)
        self.vocab, self.eos, self.pad = facts.vocab, facts.eos, facts.pad
        self._kv_source = kv_tokens or (lambda: local_kv_tokens(facts.device))
        self._kv_tokens: int | None = None
        # a fast tokenizer's call resets its backend's truncation / padding when the checkpoint
        # saved one, which concurrent calls must not meet half set ("Already borrowed"): done
        # once here, so the server's calls (none truncate or pad) only read it. No lock: an
        # 8 MiB text prompt takes seconds to tokenise, and held every other request that long
        tokenizer("")
        self._stops: dict[tuple[str, ...], list[str]] = {}

    @classmethod
    def of(cls, model, tokenizer, max_model_len: int | None = None) -> Served:
        """Served for a model in this process."""
        return cls(model_facts(model, tokenizer), tokenizer, max_model_len)

    # --- prompts (on a worker thread: a long text takes a while to tokenise) ----------------

    def encode(self, req: Request) -> list[list[int]]:
        if req.messages:
            return [self._chat_ids(req.messages)]
        out = []
        for p in req.prompts:
            ids = list(p) if isinstance(p, list) else self.tok(p)["input_ids"]
            if not ids:
                raise bad("prompt", "the prompt is empty once tokenised")
            out.append(ids)
        return out

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise bad(
                "messages", "this model's tokenizer has no chat template; use /v1/completions"
            )
        try:
            text = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # noqa: BLE001 - a template that refuses these messages
            raise bad("messages", f"the chat template refused them: {str(err)[:300]}") from None
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise bad("messages", "the conversation is empty once tokenised")
        return ids

    # --- limits -------------------------------------------------------------------------------

    def kv_tokens(self) -> int | None:
        """Tokens one row may hold in the model's KV pool (None until the pool exists)."""
        if self._kv_tokens is None:
            self._kv_tokens = self._kv_source()
        return self._kv_tokens

    def max_tokens(self, req: Request, prompts: list[list[int]]) -> int:
        """The request's max_tokens (its own, or the room left); 400 naming the limit when a
        prompt and its completion do not fit the model's context or the KV pool."""
        s, longest = req.sampling, max(map(len, prompts))
        param = "messages" if req.messages else "prompt"
        limit, what = self.max_model_len, "this model's maximum context length"
        kv = self.kv_tokens()
        if kv is not None and kv < limit:
            limit, what = kv, "the KV pool (kv.arena_bytes)"
        if longest >= limit:
            raise bad(param, f"{what} is {limit} tokens; the prompt has {longest}")
        new = s.max_tokens if s.max_tokens is not None else limit - longest
        if longest + new > limit:
            raise ApiError(
                400,
                f"{what} is {limit} tokens; this request asks for {longest + new} ({longest} in "
                f"the prompt, {new} to generate)",
                param="max_tokens",
            )  # fmt: skip
        if s.min_tokens > new:
            raise bad("min_tokens", f"{s.min_tokens} is more than the {new} tokens that fit")
        return new

    def engine_stops(self, stop: tuple[str, ...]) -> list[str]:
        """The stop strings generate() can match on tokens. transformers refuses a string no
        token of the vocabulary can spell (a ValueError for the whole call); such a string is
        still found in the text (text.py), and the call ended from the streamer. Cached."""
        ok = self._stops.get(stop)
        if ok is None:  # (threads share the cache: another may clear it between two reads)
            from transformers.generation.stopping_criteria import StopStringCriteria

            ok = []
            for s in stop:
                try:
                    StopStringCriteria(self.tok, [s])
                    ok.append(s)
                except ValueError:
                    pass
            if len(self._stops) > 1024:
                self._stops.clear()
            self._stops[stop] = ok
        return ok

    # --- the call -----------------------------------------------------------------------------

    def call(self, req: Request, prompts: list[list[int]]) -> Call:
        s = req.sampling
        new = self.max_tokens(req, prompts)
        gen: dict = {"max_new_tokens": new, "do_sample": s.temperature > 0}
        if s.temperature > 0:
            gen.update(temperature=s.temperature, top_p=s.top_p)
        if s.min_tokens:
            gen["min_new_tokens"] = s.min_tokens
        if s.stop and (stops := self.engine_stops(s.stop)):
            gen.update(stop_strings=stops, tokenizer=self.tok)
        call = Call(prompts, s.n, gen, priority=s.priority, seed=s.seed)
        call.rows = [ChoiceText(self.tok, p, new, s.stop, self.eos, incremental=s.stream)
                     for p in prompts for _ in range(s.n)]  # fmt: skip
        return call
