"""Warnings a user sees come from the user's code: generate() after enable() says nothing that
stock generate() does not (transformers 5.24 logs a deprecation when code reads an output's
`past_key_values`; oxygen must read the name the version has)."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
import transformers as T
from test_engine_errors import merged_steps
from test_hf_generate import COMMON

import oxygen_torch


def llama():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def said(fn) -> list[str]:
    """What `fn()` warns: Python deprecation warnings and transformers' logged warnings (its
    warning_once memo cleared first, so a warning an earlier test triggered is said again)."""
    logging.Logger.warning_once.cache_clear()
    logger = logging.getLogger("transformers")
    handler = _Records()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        logger.removeHandler(handler)
    deprecations = [
        str(w.message)
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]
    return deprecations + [m for m in handler.messages if "deprecat" in m.lower()]


IDS = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def generate(model, **kw):
    with torch.no_grad():
        return model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=4,
                              do_sample=False, **kw)  # fmt: skip


@pytest.mark.parametrize("calls", [1, 3])
@pytest.mark.parametrize("dict_out", [True, False])
def test_generate_after_enable_warns_no_deprecation_that_stock_does_not(oxygen, calls, dict_out):
    """One call, and three at once (merged steps), with and without return_dict_in_generate."""
    kw = {"return_dict_in_generate": True} if dict_out else {}
    stock = llama()
    stock_said = said(lambda: generate(stock, **kw))
    oxygen_torch.enable(**(merged_steps() if calls > 1 else {}))
    try:
        model = llama()
        assert model.config._attn_implementation == "oxygen"

        def run():
            threads = [threading.Thread(target=generate, args=(model,), kwargs=kw)
                       for _ in range(calls)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
                assert not t.is_alive(), "a generate() thread hung"

        ours = said(run)
    finally:
        oxygen_torch.disable()
    assert [m for m in ours if m not in stock_said] == []
