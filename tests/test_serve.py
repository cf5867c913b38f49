"""examples/serve.py on loopback: concurrent requests of two priorities, each answered with the
tokens the same generate() gives alone; bad requests get a 400 naming what was wrong; /metrics
carries the engine's figures."""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers as T
from test_hf_generate import COMMON

from oxygen_torch import _patching
from oxygen_torch.integrations.hf import integration as hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import load  # noqa: E402
import serve  # noqa: E402


@pytest.fixture
def server():
    _patching.forget_warnings()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    hf.apply(model)
    srv = serve.make_server(model, "127.0.0.1", 0, max_tokens=32)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield model, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    hf.disable_hf()


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_concurrent_requests_on_loopback_get_their_own_tokens(server):
    model, url = server
    reqs = load.trace(seed=3, n=8, rate=1e6, cv=4, high=0.3, vocab=128, max_prompt=20,
                      max_new=10)  # fmt: skip
    want = []
    for r in reqs:
        x = torch.tensor([r["prompt_ids"]])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x),
                                 max_new_tokens=r["max_tokens"], do_sample=False)  # fmt: skip
        want.append(out[0, x.shape[1] :].tolist())
    got = [None] * len(reqs)

    def one(i):
        body = {k: reqs[i][k] for k in ("prompt_ids", "max_tokens", "priority")}
        got[i] = post(url, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (status, body) in enumerate(got):
        assert status == 200, body
        assert body["ids"] == want[i] and body["priority"] == reqs[i]["priority"]
        assert body["ttft_ms"] is not None and 0 < body["ttft_ms"] <= body["total_ms"]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'oxygen:task_time_to_first_token_seconds_count{class="high"}' in text
    assert "oxygen:engine_steps_total" in text


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"prompt_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt_ids": [], "max_tokens": 4}, "prompt_ids"),
        ({"prompt_ids": [1, 999999]}, "prompt_ids: ids must be in"),
        ({"prompt_ids": [1], "priority": "urgent"}, "task priority: 'urgent'"),
        ({"max_tokens": 3}, "give prompt_ids"),
    ],
)
def test_bad_requests_are_a_400_naming_the_field(server, body, needle):
    _, url = server
    status, answer = post(url, body)
    assert status == 400 and needle in answer["error"], answer
