"""python -m oxygen_torch serve on loopback, talked to with the official `openai` client.

A tiny random-weight Llama saved to a temporary directory with a word-level tokenizer built
offline and a chat template, loaded back the way the command loads it (local files only), with
oxygen enabled and the engine on; the server (uvicorn) runs on a thread of this process on a
free loopback port, so the tests can compare with model.generate() and read kv_stats(). Every
wait is bounded in count and time."""

from __future__ import annotations

import gc
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
import transformers as T
from test_hf_generate import COMMON
from tiny_tokenizer import tiny_tokenizer

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.integrations.hf import engine_runner, front
from oxygen_torch.integrations.hf import prefix as hf_prefix
from oxygen_torch.kv.pool import release_pools
from oxygen_torch.tools.serve.app import ServeConfig, build_app
from oxygen_torch.tools.serve.http import HttpConfig, bind, server
from oxygen_torch.tools.serve.loading import load, serve_overrides, warm_up

# words the chat template uses are in the tokenizer's vocabulary ("abcdef" marks the reply)
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}abcdef{% endif %}"
)
EOS = 2
# 8 MiB of arena: 255 blocks of 16 tokens (4,080 tokens) under the model's 8,192 positions, so
# a long request meets the KV pool's limit first
OXYGEN = "kv.arena_bytes:8388608"  # (--conf's form: beside the server's own defaults)
MODEL_LEN = 8192


def save_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**COMMON, "max_position_embeddings": MODEL_LEN}))
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tok = tiny_tokenizer(COMMON["vocab_size"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


class Running:
    """A uvicorn server for `app` on a thread, on a free loopback port."""

    def __init__(self, app, **http):
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app, self.server = app, server(app, HttpConfig(port=0, log_level="warning", **http))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "uvicorn did not start within 30 s"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def loaded(ckpt):
    """oxygen enabled with the engine, the checkpoint loaded as `serve` loads it."""
    _patching.forget_warnings()
    oxygen_torch.disable()  # (an earlier file's enable() with another configuration)
    oxygen_torch.enable(**serve_overrides(OXYGEN))
    try:
        model, tok = load(str(ckpt), "float32", "cpu")
        assert model.config._attn_implementation == "oxygen"
        yield model, tok
    finally:
        oxygen_torch.disable()
        gc.collect()
        hf_prefix.clear()
        release_pools()


@pytest.fixture(scope="module")
def srv(loaded):
    model, tok = loaded
    cfg = ServeConfig(model_name="tiny", max_queue=64, max_body_bytes=256 << 10,
                      body_timeout_s=1.0)  # fmt: skip
    app = build_app(model, tok, cfg)
    warm_up(model, 0)  # the KV pool exists: its size bounds requests
    running = Running(app, header_timeout_s=1.0)
    yield running
    running.stop()


def reference(model, ids: list[int], new: int, **kw) -> list[int]:
    """model.generate() on the same prompt: its new tokens up to and with the first EOS."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                             do_sample=False, **kw)[0, len(ids) :].tolist()  # fmt: skip
    return out[: out.index(EOS) + 1] if EOS in out else out


def words(tok, ids: list[int]) -> list[str]:
    return [w for w in tok.convert_ids_to_tokens(ids) if w not in ("<pad>", "<s>", "</s>")]


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def http(url: str, method: str = "GET", body=None, headers: dict | None = None) -> Reply:
    """A plain request (the standard library): for what the openai client does not send."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with _direct.open(req, timeout=30) as r:
            return Reply(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, dict(err.headers), err.read())


def blocks_in_use() -> int:
    return sum(p["blocks_used"] for p in oxygen_torch.kv_stats())


def wait_for(cond, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def clients(one, n: int) -> list:
    """one(i) for i < n, each on a thread of its own (bounded joins); the errors raised."""
    errors: list = []

    def run(i):
        try:
            one(i)
        except Exception as err:  # noqa: BLE001 - returned to the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a client hung"
    return errors


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie too: exited, its parent not yet told)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


PROMPTS = [[5, 9, 11, 13], [40, 41, 42, 43, 44, 45, 46], [100, 7]]


def test_models_health_and_metrics(srv):
    assert [m.id for m in srv.client().models.list()] == ["tiny"]
    assert http(srv.url + "/health").json() == {"status": "ok"}
    head = http(srv.url + "/health", method="HEAD")
    assert head.status == 200 and head.body == b""
    text = http(srv.url + "/metrics").body.decode()
    assert 'oxygen:serve_requests{state="waiting"}' in text and "oxygen:serve_max_queue 64" in text


def test_the_server_defaults_give_way_to_the_configuration(monkeypatch, srv):
    """serve turns the engine on and wakes streams at most every 10 ms unless --conf,
    OXYGEN_CONF or the file says otherwise (the running server: its defaults)."""
    assert oxygen_torch.active_config().scheduler.stream_interval_ms == 10
    monkeypatch.delenv("OXYGEN_CONF", raising=False)
    monkeypatch.delenv("OXYGEN_CONFIG_FILE", raising=False)
    assert serve_overrides("") == {"scheduler.engine": True, "scheduler.stream_interval_ms": 10}
    got = serve_overrides("scheduler.stream_interval_ms:0,kv.block_tokens:32")
    assert got == {"scheduler.stream_interval_ms": 0, "kv.block_tokens": 32,
                   "scheduler.engine": True}  # fmt: skip
    monkeypatch.setenv("OXYGEN_CONF", "scheduler.engine:false,scheduler.stream_interval_ms:3")
    assert serve_overrides("") == {}


@pytest.mark.parametrize("as_text", [False, True])
def test_greedy_completions_equal_generate(srv, loaded, as_text):
    model, tok = loaded
    c = srv.client()
    for ids in PROMPTS:
        want = reference(model, ids, 12)
        prompt = " ".join(tok.convert_ids_to_tokens(ids)) if as_text else ids
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})  # fmt: skip
        (choice,) = r.choices
        assert choice.token_ids == want and r.prompt_token_ids == [ids]
        assert choice.text.split() == words(tok, want)
        assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))


def test_chat_greedy_equals_generate_on_the_template(srv, loaded):
    model, tok = loaded
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w20 w21"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]  # fmt: skip
    want = reference(model, ids, 10)
    r = srv.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.token_ids == want and choice.message.role == "assistant"
    assert choice.message.content.split() == words(tok, want)
    assert r.usage.prompt_tokens == len(ids)


def test_requests_run_on_the_engine_not_the_per_call_path(srv, loaded):
    model, _ = loaded
    front.REASONS.clear()
    before = engine_runner.engine_stats(model)["steps"]
    srv.client().completions.create(
        model="tiny", prompt=["w5 w6", [7, 8, 9]], max_tokens=8, temperature=0.7, top_p=0.9, n=2,
        seed=3, stop=["w9"], extra_body={"min_tokens": 2, "priority": "low"},
    )  # fmt: skip
    assert not front.REASONS, front.REASONS
    assert engine_runner.engine_stats(model)["steps"] > before


def collect(stream) -> tuple[dict, dict, object]:
    """Joined text deltas and finish reasons per choice index, and the usage chunk."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_non_streamed_with_n_and_seed(srv, chat):
    c = srv.client()
    kw = dict(model="tiny", max_tokens=14, temperature=0.9, top_p=0.95, n=3, seed=1234)
    if chat:
        kw["messages"] = [{"role": "user", "content": "w5 w6 w7"}]
        create = c.chat.completions.create
    else:
        kw["prompt"] = "w5 w6 w7"
        create = c.completions.create
    whole = create(**kw)
    texts, finish, usage = collect(
        create(**kw, stream=True, stream_options={"include_usage": True})
    )
    got = [ch.message.content if chat else ch.text for ch in whole.choices]
    assert [texts.get(i, "") for i in range(3)] == got
    assert [finish[i] for i in range(3)] == [ch.finish_reason for ch in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert len(set(got)) > 1, "three sampled choices, all the same text"


def test_seed_reproducible_and_another_seed_differs(srv):
    c = srv.client()

    def texts(seed):
        r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0,
                                 n=2, seed=seed)  # fmt: skip
        return [ch.text for ch in r.choices]

    first = texts(7)
    assert texts(7) == first
    assert texts(8) != first


def test_stop_strings_end_the_text_before_them(srv, loaded):
    model, tok = loaded
    ids = PROMPTS[1]
    want = reference(model, ids, 16)
    assert EOS not in want[:4], "the probe needs a continuation of 4 tokens"
    stop = tok.convert_ids_to_tokens([want[3]])[0]
    first = want.index(want[3])  # the stop word's first place in the continuation
    c = srv.client()
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                             stop=[stop, "w999"])  # fmt: skip
    assert r.choices[0].text.split() == words(tok, want[:first])
    assert r.choices[0].finish_reason == "stop"
    stream = c.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                                  stop=stop, stream=True)  # fmt: skip
    texts, finish, _ = collect(stream)
    assert texts[0] == r.choices[0].text and finish[0] == "stop"


def test_a_stop_string_no_token_can_spell_is_still_a_stop_string(srv, loaded):
    """transformers refuses a stop string no token spells ("zz" here) for the whole call: the
    server keeps it out of generate() and looks for it in the text."""
    model, tok = loaded
    want = reference(model, PROMPTS[0], 8)
    r = srv.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0, stop=["zz", "w999"])  # fmt: skip
    assert r.choices[0].text.split() == words(tok, want)


def test_concurrent_clients_with_priorities_get_their_own_tokens(srv, loaded):
    model, tok = loaded
    prompts = [[3 + 11 * i + j for j in range(4 + i % 5)] for i in range(8)]
    want = [reference(model, p, 6 + i % 7) for i, p in enumerate(prompts)]
    got = [None] * 8

    def one(i):
        prio = ("high", "normal", "low")[i % 3]
        way = (
            {"extra_headers": {"X-Priority": prio}} if i % 2 else {"extra_body": {"priority": prio}}
        )
        body = way.setdefault("extra_body", {})
        body["return_token_ids"] = True
        r = srv.client().completions.create(model="tiny", prompt=prompts[i], temperature=0,
                                            max_tokens=6 + i % 7, **way)  # fmt: skip
        got[i] = r.choices[0].token_ids

    errors = clients(one, 8)
    assert not errors, errors
    assert got == want
    text = http(srv.url + "/metrics").body.decode()
    classes = {
        line.split('class="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("oxygen:task_time_to_first_token_seconds_count")
    }
    assert {"high", "low"} <= classes <= {"high", "normal", "low"}


class Slow:
    """The embedding's forward, `delay` s slower: a generation outlasts a disconnect."""

    def __init__(self, model, delay: float):
        self.emb, self.delay = model.get_input_embeddings(), delay

    def __enter__(self):
        forward = type(self.emb).forward.__get__(self.emb)

        def slow(*a, **k):
            time.sleep(self.delay)
            return forward(*a, **k)

        self.emb.forward = slow
        return self

    def __exit__(self, *exc):
        del self.emb.forward


def cancelled(srv) -> int:
    return srv.app.state.server.admission.counts["cancelled"]


def test_a_disconnect_mid_stream_ends_the_call_and_frees_its_blocks(srv, loaded):
    model, _ = loaded
    before = cancelled(srv)
    with Slow(model, 0.02):  # 200 tokens would take 4 s or more
        stream = srv.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200,
                                                 temperature=0.8, stream=True,
                                                 extra_body={"min_tokens": 200})  # fmt: skip
        for n, _chunk in enumerate(stream):
            if n == 2:
                break
        assert blocks_in_use() > 0
        stream.close()
        # cancelled, not finished: the call did not reach its 200 tokens (min_tokens: nor a
        # sampled EOS)
        assert wait_for(lambda: cancelled(srv) == before + 1 and blocks_in_use() == 0, 10)


def test_a_client_that_leaves_a_non_streamed_call_ends_it(srv, loaded):
    model, _ = loaded
    before = cancelled(srv)
    with Slow(model, 0.02):
        with pytest.raises(openai.APITimeoutError):
            srv.client(timeout=0.5).completions.create(model="tiny", prompt=PROMPTS[1],
                                                      max_tokens=200,
                                                      extra_body={"min_tokens": 200})  # fmt: skip
        assert wait_for(lambda: cancelled(srv) == before + 1 and blocks_in_use() == 0, 10)
