"""The server's limits on loopback: every bad input gets OpenAI's error object with its 4xx and
the server goes on serving; bodies, headers and idle connections have deadlines; a burst past
--max-queue gets 429 with Retry-After; the command itself (a subprocess) wants its API key.
The server and model are test_serve.py's (a checkpoint loaded from transformers: this file runs
on both ends of its range, Makefile's RANGE_IMPORTS); every wait is bounded in count and time."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import test_serve as ts
from test_serve import Reply, Running, Slow, blocks_in_use, http, process_gone, wait_for

from oxygen_torch.tools.serve.app import ServeConfig, build_app
from oxygen_torch.tools.serve.protocol import Request, Sampling
from oxygen_torch.tools.serve.served import Served

ROOT = Path(__file__).resolve().parents[1]
ckpt, loaded, srv = ts.ckpt, ts.loaded, ts.srv  # test_serve's fixtures: its model and server
GOOD = {"model": "tiny", "prompt": [5, 9, 11], "max_tokens": 3, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}


def post(url: str, body, path: str = "/v1/completions") -> Reply:
    return http(url + path, "POST", body, {"Content-Type": "application/json"})


BAD = [  # (body, status, what the message or param names)
    (b'{"prompt": ', 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": [1], "temperature": NaN}', 400, "NaN"),
    (b'{"prompt": [1], "top_p": 1e400}', 400, "out of range"),
    (b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
    (b'{"prompt": [1], "n": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
    ({**GOOD, "prompt": 5}, 400, "prompt"),
    ({**GOOD, "prompt": []}, 400, "prompt"),
    ({**GOOD, "prompt": [1, 999999]}, 400, "prompt"),
    ({**GOOD, "prompt": [1, True]}, 400, "prompt"),
    ({**GOOD, "max_tokens": "10"}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 10**400}, 400, "max_tokens"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "temperature": 1e-300}, 400, "temperature"),
    ({**GOOD, "temperature": -1}, 400, "temperature"),
    ({**GOOD, "temperature": 10**400}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "n": 1.5}, 400, "n"),
    ({**GOOD, "n": 0}, 400, "n"),
    ({**GOOD, "n": 1000}, 400, "n"),
    ({**GOOD, "stop": 3}, 400, "stop"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({**GOOD, "stop": [""]}, 400, "stop"),
    ({**GOOD, "stream": "yes"}, 400, "stream"),
    ({**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**GOOD, "seed": -1}, 400, "seed"),
    ({**GOOD, "seed": 2**64}, 400, "seed"),
    ({**GOOD, "priority": 10**400}, 400, "priority"),
    ({**GOOD, "priority": "urgent"}, 400, "priority"),
    ({**GOOD, "priority": 7}, 400, "priority"),
    ({**GOOD, "priority": [2]}, 400, "priority"),
    ({**GOOD, "priority": "\u00b2"}, 400, "priority"),  # str.isdigit() but no int(): was a 500
    ({**GOOD, "priority": "\u0662"}, 400, "priority"),  # an Arabic-Indic 2: was taken as 2
    ({**GOOD, "logprobs": 5}, 400, "logprobs"),
    ({**GOOD, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({**GOOD, "min_tokens": 5}, 400, "min_tokens"),
    ({**GOOD, "model": "gpt-4"}, 404, "model"),
    ({**GOOD, "model": ["tiny"]}, 400, "model"),
    ({**GOOD, "prompt": [5] * 200, "max_tokens": 8000}, 400, "max_tokens"),
    ({**GOOD, "prompt": [5] * 4100}, 400, "KV pool"),
    ({**GOOD, "prompt": [5] * 100_000}, 413, "larger than"),
]


@pytest.mark.parametrize("body, status, names", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_completions_input_is_a_4xx_naming_it(srv, body, status, names):
    r = post(srv.url, body)
    assert r.status == status, r.text
    err = r.json()["error"]
    assert names in err["message"] or names == err["param"], err
    assert set(err) == {"message", "type", "param", "code"}


BAD_CHAT = [
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "w5"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body, names", BAD_CHAT, ids=[f"chat{i}" for i in range(len(BAD_CHAT))])
def test_bad_chat_input_is_a_400_naming_it(srv, body, names):
    r = post(srv.url, body, "/v1/chat/completions")
    assert r.status == 400, r.text
    assert names in r.json()["error"]["message"]


@pytest.mark.parametrize("value", ["\u00b2", "9" * 500, "urgent", "-1"])
def test_a_bad_x_priority_header_is_a_400_naming_it(srv, value):
    r = http(srv.url + "/v1/completions", "POST", GOOD, {"X-Priority": value})
    assert r.status == 400, r.body[:300]
    assert r.json()["error"]["param"] == "X-Priority"


def test_other_methods_and_paths_are_json_errors_and_the_server_keeps_serving(srv):
    r = http(srv.url + "/v1/completions", "PUT")
    assert r.status == 405 and "error" in r.json()
    r = http(srv.url + "/v1/nothing")
    assert r.status == 404 and "error" in r.json()
    r = post(srv.url, GOOD)
    assert r.status == 200 and len(r.json()["choices"][0]["text"].split()) >= 1
    assert post(srv.url, CHAT, "/v1/chat/completions").status == 200
    assert blocks_in_use() == 0
    counts = srv.app.state.server.admission.counts
    assert counts["error"] == 0, counts  # no bad input reached generate() and failed there


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens",
          "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "priority",
          "logprobs", "echo", "return_token_ids", "best_of", "logit_bias", "tools"]  # fmt: skip


def anything(rng, depth: int = 0):
    """A JSON value of any type, often an edge (huge, tiny, negative, empty, nested)."""
    pick = rng.randrange(10)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice([0, 1, 2, -1, 3, 16, 10**400, 2**63, -(2**63)])
    if pick == 2:
        return rng.choice([0.0, 0.5, 1e-300, 2.5, -0.1, 1.0, 1e300])
    if pick == 3:
        return rng.choice(["", "w5 w6", "high", "tiny", "\u0000", "abcdef", "x" * 300, "zz"])
    if pick == 4 and depth < 3:
        return [anything(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 5 and depth < 3:
        keys = FIELDS + ["role", "content", "type", "text", "include_usage"]
        return {rng.choice(keys): anything(rng, depth + 1) for _ in range(rng.randrange(3))}
    if pick == 6:
        return [rng.randrange(-2, 200) for _ in range(rng.randrange(5))]
    if pick == 7:
        roles, contents = ["user", "assistant", "system", "x"], ["w5", 5, None, []]
        return [{"role": rng.choice(roles), "content": rng.choice(contents)}
                for _ in range(rng.randrange(3))]  # fmt: skip
    return rng.choice([3, 8, "w5", ["w5", "w7"], [[5, 6], [7]]])


def test_random_bodies_never_get_a_5xx_and_leave_nothing_behind(srv):
    rng = random.Random(33)
    seen = set()
    for _ in range(150):
        body = {f: anything(rng) for f in rng.sample(FIELDS, rng.randrange(1, 7))}
        if rng.random() < 0.7:  # mostly a valid request with a few odd fields
            body = {k: v for k, v in body.items() if rng.random() < 0.4}
            body = {"prompt": "w5 w6", "messages": CHAT["messages"], "max_tokens": 4, **body}
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        head = {"X-Priority": rng.choice(["high", "1", "bad", "9" * 500])}
        r = http(srv.url + path, "POST", body, head if rng.random() < 0.3 else {})
        assert r.status < 500, (path, body, r.body[:300])
        seen.add(r.status)
    assert {200, 400} <= seen
    assert srv.app.state.server.admission.counts["error"] == 0
    assert wait_for(lambda: blocks_in_use() == 0, 10)


def raw(url: str, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Sends raw bytes; returns what came back until the server closed (or `wait` passed)."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        if data:
            s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            got += b"<still open>"
    return got, time.monotonic() - t0


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("length", [b"abc", b"-5", b"9" * 5000])
def test_a_content_length_that_is_no_number_is_a_400(srv, length):
    got, _ = raw(srv.url, HEAD + b"Content-Length: " + length + b"\r\n\r\n{}")
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and "invalid HTTP request" in error["message"]


def test_a_body_shorter_than_its_length_is_a_408_within_the_deadline(srv):
    got, took = raw(srv.url, HEAD + b"Content-Length: 100\r\n\r\n{}")
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive" in got, got[:300]
    assert took < 5  # body_timeout_s 1


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_whole_request_head_is_closed(srv, sent):
    got, took = raw(srv.url, sent)
    assert got == b"" and took < 5  # header_timeout_s 1


def test_idle_connections_hold_no_worker(srv):
    socks = []
    try:
        for _ in range(50):
            host, port = srv.url.removeprefix("http://").split(":")
            socks.append(socket.create_connection((host, int(port)), timeout=10))
        assert post(srv.url, GOOD).status == 200  # served beside 50 idle connections
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def gated(loaded):
    """A second app on the same model: max_queue 2, a 64-token context; its forwards wait on
    `gate` (no request gets a first token until the test opens it)."""
    model, tok = loaded
    app = build_app(model, tok, ServeConfig(model_name="tiny", max_queue=2, max_model_len=64))
    running = Running(app)
    gate = threading.Event()

    class Gate(Slow):
        def __enter__(self):
            forward = type(self.emb).forward.__get__(self.emb)

            def wait(*a, **k):
                gate.wait(60)
                return forward(*a, **k)

            self.emb.forward = wait
            return self

    with Gate(model, 0):
        try:
            yield running, gate
        finally:
            gate.set()
    running.stop()


def test_a_burst_past_max_queue_is_429_with_retry_after(gated):
    running, gate = gated
    waiting = running.app.state.server.admission
    out = {}

    def first(i):
        out[i] = running.client().completions.create(model="tiny", prompt=[5, 6], max_tokens=4)

    threads = [threading.Thread(target=first, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: waiting.waiting == 2, 30)
    for _ in range(4):
        with pytest.raises(openai.RateLimitError) as err:
            running.client().completions.create(model="tiny", prompt=[5, 6], max_tokens=4)
        assert err.value.response.headers["Retry-After"] == "1"
        assert "--max-queue 2" in err.value.message
    gate.set()
    for t in threads:
        t.join(60)
    assert len(out) == 2 and all(len(r.choices) == 1 for r in out.values())
    assert running.client().completions.create(model="tiny", prompt=[5], max_tokens=2).choices
    assert waiting.counts["rejected"] == 4


def test_a_request_longer_than_the_context_is_a_400_naming_it(gated):
    running, gate = gated
    gate.set()
    r = post(running.url, {**GOOD, "prompt": [5] * 60, "max_tokens": 10})
    assert r.status == 400
    assert "maximum context length is 64 tokens" in r.json()["error"]["message"]
    r = post(running.url, {**CHAT, "max_tokens": None, "temperature": 0}, "/v1/chat/completions")
    body = r.json()
    assert r.status == 200 and body["usage"]["total_tokens"] <= 64, body


def test_the_command_serves_and_wants_its_api_key(ckpt):
    env = {**os.environ, "OXYGEN_API_KEY": "sekrit", "OXYGEN_CONF": "kv.arena_bytes:8MiB"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "oxygen_torch", "serve", str(ckpt), "--port", "0", "--model-name",
         "tiny", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        url, engine, said = None, None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                said.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1 .*engine process (\d+), "
                              r"engine on", said[-1]):  # fmt: skip
                url, engine = m.group(1), int(m.group(2))
        assert url, "".join(said)[-3000:]
        c = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model="tiny", prompt=[5, 6], max_tokens=2)
        assert post(url, GOOD).status == 401  # no Authorization header at all
        assert http(url + "/v1/models").status == 401
        assert http(url + "/health").status == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                      max_tokens=3, temperature=0)  # fmt: skip
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    # the engine's process ends with the server's (its pipe closed): none left behind
    gone = engine is None or wait_for(lambda: process_gone(engine), 30)
    assert gone, f"engine process {engine} is still running"


class HeldTokenizer:
    """The checkpoint's tokenizer; encoding `held` waits for `gate` (a long prompt's encode)."""

    def __init__(self, tok, held: str):
        self.tok, self.held = tok, held
        self.gate, self.inside = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        if text == self.held:
            self.inside.set()
            self.gate.wait(30)
        return self.tok(text, **kw)


def test_a_long_prompt_being_tokenised_holds_up_no_other_request(loaded):
    """An 8 MiB text prompt took ~7 s to tokenise under one lock, and every request waited."""
    model, tok = loaded
    held = HeldTokenizer(tok, "w9 w9 w9")
    served = Served.of(model, held)
    long = threading.Thread(target=served.encode, args=(Request(Sampling(), prompts=[held.held]),))
    long.start()
    try:
        assert held.inside.wait(10)
        short: list = []
        other = threading.Thread(
            target=lambda: short.append(served.encode(Request(Sampling(), prompts=["w5 w6"])))
        )
        other.start()
        other.join(5)
        assert short == [[[5, 6]]], "a short prompt waited for the long one's tokenising"
    finally:
        held.gate.set()
        long.join(30)


def test_a_saved_truncation_is_reset_before_any_request(loaded):
    """Encodes run concurrently: the one call that changes the backend's state is made first."""
    from tiny_tokenizer import tiny_tokenizer

    model, _ = loaded
    tok = tiny_tokenizer(128)
    tok.backend_tokenizer.enable_truncation(4)  # as a checkpoint's tokenizer.json may say
    served = Served.of(model, tok)
    assert tok.backend_tokenizer.truncation is None
    got = served.encode(Request(Sampling(), prompts=["w5 " * 50]))
    assert got == [[5] * 50]


def test_a_body_being_checked_does_not_stop_the_event_loop(srv, monkeypatch):
    """An 8 MiB body of token ids took ~0.9 s to parse and check, and held every stream."""
    from oxygen_torch.tools.serve import app

    gate, inside, parse = threading.Event(), threading.Event(), app.parse_json

    def held(body: bytes):
        if b'"w9 w9"' in body:
            inside.set()
            gate.wait(10)
        return parse(body)

    monkeypatch.setattr(app, "parse_json", held)
    out: list = []
    slow = threading.Thread(target=lambda: out.append(post(srv.url, {**GOOD, "prompt": "w9 w9"})))
    slow.start()
    try:
        assert inside.wait(10)
        t0 = time.monotonic()
        health = http(srv.url + "/health")
        assert health.status == 200 and time.monotonic() - t0 < 2
    finally:
        gate.set()
        slow.join(30)
    assert out[0].status == 200


@pytest.mark.parametrize(
    "field, value, allowed",
    [("max_queue", 0, ">= 1"), ("max_body_bytes", 10, ">= 1024"), ("body_timeout_s", 0, "> 0"),
     ("retry_after_s", -1, ">= 0"), ("max_model_len", 1, ">= 2"),
     ("api_key", "", "a non-empty string")],
)  # fmt: skip
def test_a_bad_server_setting_names_the_field_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        ServeConfig(model_name="tiny", **{field: value})
    assert str(err.value) == f"ServeConfig.{field}: {value!r} is not allowed; allowed: {allowed}"
