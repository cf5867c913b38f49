"""The JSON the server answers with, shaped as OpenAI's: whole responses and stream chunks."""

from __future__ import annotations

import json
import time
import uuid

from .jobs import Call


class Answer:
    """The response of one request: its id, kind (chat or not), and the call's rows."""

    def __init__(self, call: Call, model: str, chat: bool, token_ids: bool = False):
        self.call, self.model, self.chat, self.token_ids = call, model, chat, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}  # fmt: skip

    def usage(self) -> dict:
        prompt = sum(map(len, self.call.prompts))
        done = sum(len(r.ids) for r in self.call.rows)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def whole(self) -> dict:
        """The non-streamed response, once the call has returned."""
        choices = []
        for i, row in enumerate(self.call.rows):
            c = {"index": i}
            if self.chat:
                c["message"] = {"role": "assistant", "content": row.text}
            else:
                c["text"] = row.text
            c.update(logprobs=None, finish_reason=row.finish or "stop")
            if self.token_ids:
                c["token_ids"] = list(row.ids)
            choices.append(c)
        out = {**self._head(False), "choices": choices, "usage": self.usage()}
        if self.token_ids:
            out["prompt_token_ids"] = self.call.prompts
        return out

    # --- server-sent events ---------------------------------------------------------------

    def _choice(self, i: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        c: dict = {"index": i}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            c["delta"] = delta
        else:
            c["text"] = text or ""
        c.update(logprobs=None, finish_reason=finish)
        return c

    def event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = {**self._head(True), "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def opening(self) -> list[bytes]:
        """A chat stream opens with each choice's role."""
        if not self.chat:
            return []
        return [self.event([self._choice(i, None, None, role=True)])
                for i in range(len(self.call.rows))]  # fmt: skip

    def texts(self, deltas: list[str]) -> bytes:
        return self.event([self._choice(i, d, None) for i, d in enumerate(deltas) if d])

    def closing(self, include_usage: bool) -> list[bytes]:
        """Each choice's finish reason, then the usage when asked for, then [DONE]."""
        out = []
        for i, row in enumerate(self.call.rows):
            c = self._choice(i, None, row.finish or "stop")
            if self.token_ids:
                c["token_ids"] = list(row.ids)
            out.append(self.event([c]))
        if include_usage:
            out.append(self.event([], usage=self.usage()))
        return out + [b"data: [DONE]\n\n"]


def error_event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
