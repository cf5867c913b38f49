"""A small HTTP completions endpoint: each request is a generate() in its own thread, tagged with
its priority; oxygen_torch merges the concurrent calls' steps on one paged KV cache.

    python examples/serve.py                          # random-weight Llama (tiny on CPU)
    python examples/serve.py /path/to/ckpt --port 8000
    curl -s 127.0.0.1:8000/v1/completions \\
         -d '{"prompt_ids": [5, 6, 7], "max_tokens": 16, "priority": "high"}'

POST /v1/completions, a JSON object:
  prompt_ids   list of token ids (or "prompt": text, through the checkpoint's tokenizer when
               there is one, else its UTF-8 bytes as ids)
  max_tokens   new tokens (default 16, at most --max-tokens)
  priority     "high" / "normal" / "low" or an integer level (default "normal")
  temperature  0 (default: greedy) or > 0 (sampling, with top_p)
Answer: {"ids": [...], "text": ..., "ttft_ms": ..., "total_ms": ..., "priority": ...}.
GET /metrics: Prometheus text (the engine's time to first token and per token by class, queue
depth, preemptions, the pool). GET /health: "ok". Binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import oxygen_torch

MAX_BODY = 1 << 20
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024)  # fmt: skip
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip


class BadRequest(ValueError):
    pass


class Completions:
    """The model side: turns a request's JSON into one generate() call (in the caller's thread)."""

    def __init__(self, model, tokenizer=None, max_tokens: int = 256):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.vocab = model.config.vocab_size

    def ids_of(self, body: dict) -> list[int]:
        if "prompt_ids" in body:
            ids = body["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise BadRequest("prompt_ids: a non-empty list of integers")
            if any(not 0 <= i < self.vocab for i in ids):
                raise BadRequest(f"prompt_ids: ids must be in [0, {self.vocab})")
            return ids
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("give prompt_ids (a list of ints) or prompt (a non-empty string)")
        if self.tokenizer is not None:
            return self.tokenizer(text)["input_ids"]
        return [b % self.vocab for b in text.encode()]

    def __call__(self, body: dict) -> dict:
        ids = self.ids_of(body)
        new = body.get("max_tokens", 16)
        if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= self.max_tokens:
            raise BadRequest(f"max_tokens: an integer from 1 to {self.max_tokens}")
        temperature = body.get("temperature", 0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise BadRequest("temperature: a number >= 0")
        if temperature < 0:
            raise BadRequest("temperature: a number >= 0")
        priority = body.get("priority", "normal")
        device = next(self.model.parameters()).device
        x = torch.tensor([ids], device=device)
        kw = dict(max_new_tokens=new, do_sample=temperature > 0, attention_mask=torch.ones_like(x))
        if temperature > 0:
            kw.update(temperature=float(temperature), top_p=0.95)
        t0 = time.perf_counter()
        first = []
        try:
            with oxygen_torch.task(priority=priority, name=f"http-{priority}"):
                with torch.no_grad():
                    out = self.model.generate(x, streamer=_FirstToken(first), **kw)
        except ValueError as err:  # a bad priority, or what generate() refuses
            raise BadRequest(str(err)) from None
        t1 = time.perf_counter()
        got = out[0, len(ids) :].tolist()
        text = self.tokenizer.decode(got) if self.tokenizer is not None else None
        ttft = (first[0] - t0) * 1000 if first else None
        return dict(ids=got, text=text, ttft_ms=ttft, total_ms=(t1 - t0) * 1000, priority=priority)


class _FirstToken:
    """A streamer that notes when the first generated token arrives."""

    def __init__(self, into: list):
        self.into, self.prompt_seen = into, False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            self.prompt_seen = True
        elif not self.into:
            self.into.append(time.perf_counter())

    def end(self) -> None:
        pass


def handler_for(completions: Completions):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: one line per request is the load test's job
            pass

        def _send(self, status: int, payload, ctype="application/json") -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._send(HTTPStatus.OK, b"ok", "text/plain")
            elif self.path == "/metrics":
                from oxygen_torch.tools import metrics

                self._send(HTTPStatus.OK, metrics.scrape().encode(), "text/plain; version=0.0.4")
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}"})

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/completions":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}"})
                return
            try:
                size = int(self.headers.get("Content-Length", "0"))
                if not 0 < size <= MAX_BODY:
                    raise BadRequest(f"a JSON body of 1 to {MAX_BODY} bytes")
                body = json.loads(self.rfile.read(size))
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                self._send(HTTPStatus.OK, completions(body))
            except (BadRequest, json.JSONDecodeError, UnicodeDecodeError) as err:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(err)})
            except Exception as err:  # noqa: BLE001 - the server keeps serving the others
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(err)})

    return Handler


def make_server(model, host: str = "127.0.0.1", port: int = 8000, tokenizer=None,
                max_tokens: int = 256) -> ThreadingHTTPServer:  # fmt: skip
    """An HTTP server (one thread per request) over `model`; call serve_forever()."""
    server = ThreadingHTTPServer(
        (host, port), handler_for(Completions(model, tokenizer, max_tokens))
    )
    server.daemon_threads = True
    return server


def build_model(checkpoint: str | None, device: str):
    import transformers as T

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = None
    if checkpoint:
        model = T.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        try:
            tokenizer = T.AutoTokenizer.from_pretrained(checkpoint)
        except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer: byte ids
            tokenizer = None
    else:
        torch.manual_seed(0)
        shape = LLAMA_1B if device == "cuda" else TINY
        model = T.LlamaForCausalLM(T.LlamaConfig(**shape, max_position_embeddings=4096))
    model = model.to(dtype).to(device).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model, tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="local model directory (default: random Llama)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-tokens", type=int, default=1024)
    args = p.parse_args()
    oxygen_torch.enable()  # before the model is built: it takes the oxygen attention
    model, tokenizer = build_model(args.checkpoint, args.device)
    server = make_server(model, args.host, args.port, tokenizer, args.max_tokens)
    print(f"serving on http://{args.host}:{server.server_address[1]}/v1/completions", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    threading.current_thread().name = "serve"
    main()
