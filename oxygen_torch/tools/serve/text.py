"""One choice's text as its tokens arrive: incremental detokenisation, stop strings, finish.

Tokens are decoded a few at a time against the tokens before them (vLLM's incremental
detokeniser: a token's text depends on its neighbours, e.g. SentencePiece's leading space), so a
step costs the same whatever the length so far. The first token is decoded after the prompt's
last few tokens, so a completion's leading space is kept. Text that could be the start of a stop
string is held back until it is not; the text a client gets stops before the stop string (as
OpenAI's). Streamed deltas joined are the whole text: both answers come from this one path.
A row nobody reads as it comes (not streamed, no stop string: `incremental=False`) is decoded
once, when it ends: its worker thread then does no tokenizer work a step, beside the engine's.
"""

from __future__ import annotations

# prompt tokens decoded before the first new token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_
# OFFSET): enough for a tokenizer's merge of a token with its left neighbour
CONTEXT_TOKENS = 5


def decoder(tokenizer):
    """ids -> text as ``tokenizer.decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)``. For a fast tokenizer whose decoding transformers does
    not change (its class keeps the library's own decode), the Rust tokenizer's decode itself:
    what transformers' decode calls after ~40 us of Python a call (two calls a streamed token,
    on the worker threads beside the engine's launches)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (a transformers without that layout: its own decode)
        TokenizersBackend = None  # noqa: N806
    cls = type(tokenizer)
    if (
        TokenizersBackend is not None
        and backend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and cls._decode is TokenizersBackend._decode
        and cls.decode is PreTrainedTokenizerBase.decode
    ):
        rust = backend.decode
        return lambda ids: rust(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


class ChoiceText:
    """The text of one row: ``add(token)`` returns the text that may be sent now."""

    def __init__(self, tokenizer, prompt_ids: list[int], max_tokens: int,
                 stop: tuple[str, ...] = (), eos: frozenset[int] = frozenset(),
                 incremental: bool = True):  # fmt: skip
        self.max_tokens, self.stop, self.eos = max_tokens, stop, eos
        self._decode = decoder(tokenizer)
        self.incremental = incremental or bool(stop)  # stop strings are found as text comes
        self.ids: list[int] = []  # generated, the EOS that ended it included
        self.seq = list(prompt_ids[-CONTEXT_TOKENS:])  # what is decoded: context, then text ids
        self.prefix, self.read = 0, len(self.seq)  # the decode windows into seq
        self.text = ""  # decoded so far (held-back text included), cut at a stop string
        self.sent = 0  # characters of text given out
        self.finish: str | None = None  # "stop" or "length" once the row has ended
        self.stopped = False  # ended at a stop string
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _delta(self, final: bool = False) -> str:
        before = self._decode(self.seq[self.prefix : self.read])
        now = self._decode(self.seq[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.seq)
            return now[len(before) :]
        return ""  # an incomplete character: wait for the next token

    def add(self, token: int) -> str:
        """Takes the row's next token; returns the text to send now ("" if none)."""
        if self.finish is not None:
            return ""  # the engine pads rows that ended before their call's last row
        self.ids.append(token)
        eos = token in self.eos
        if not eos:  # an EOS ends the text and is not part of it
            self.seq.append(token)
        if not self.incremental:  # decoded when it ends; end() gives the text out
            if eos or len(self.ids) >= self.max_tokens:
                self.text += self._delta(final=True)
                self.finish = "stop" if eos else "length"
            return ""
        self.text += self._delta(final=eos)
        if self._cut_at_stop() or eos:
            self.finish = "stop"
            return self._release(len(self.text))
        if len(self.ids) >= self.max_tokens:
            return self.end()
        return self._release(len(self.text) - self.hold)

    def add_many(self, tokens: list[int]) -> str:
        """add() of each token, the texts joined, decoding once: a streamed row woken for the
        steps since its last wake (scheduler.stream_interval_ms) decodes once a wake, not twice
        a token. A row with stop strings takes them one by one (where the text first holds
        one decides the tokens it counts)."""
        if len(tokens) == 1 or self.stop or not self.incremental:
            return "".join(self.add(t) for t in tokens)
        for t in tokens:
            if self.finish is not None:
                break  # (ended at an EOS or max_tokens: the rest is the engine's padding)
            self.ids.append(t)
            if t in self.eos:
                self.text += self._delta(final=True)
                self.finish = "stop"
                return self._release(len(self.text))
            self.seq.append(t)
            if len(self.ids) >= self.max_tokens:
                return self.end()
        if self.finish is None:
            self.text += self._delta()
        return self._release(len(self.text) - self.hold)

    def end(self) -> str:
        """The row ended (it reached max_tokens, or its call returned: the engine matched a
        stop string or an EOS the row did not see as one): what is left to send."""
        if self.finish is None:
            self.text += self._delta(final=True)
            cut = self._cut_at_stop()
            self.finish = "stop" if cut or len(self.ids) < self.max_tokens else "length"
        return self._release(len(self.text))

    def _cut_at_stop(self) -> bool:
        """Finds the first stop string in the new text; cuts the text before it."""
        if not self.stop:
            return False
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text, self.finish, self.stopped = self.text[: min(hits)], "stop", True
        return True

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out
