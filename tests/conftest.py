"""Test set-up shared by every test file.

On a machine without CUDA, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be
set before any @triton.jit function is defined, so it is set here, before the tests import anything.
Tests marked `cuda` are skipped cleanly there; on the H200 they run.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # the server's tests need the serve and dev extras (pip install -e ".[serve,dev]")
    import fastapi  # noqa: F401
    import openai  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_serve*.py"]


def pytest_addoption(parser):
    parser.addoption(
        "--reverse", action="store_true", help="run the tests in reverse order (any order passes)"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the H200 device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _per_call_path(request, monkeypatch):
    """Tests marked `per_call` run with scheduler.engine=false: they pin the per-call path
    (each call's own loop, merged step by step), which calls the engine does not take use."""
    if request.node.get_closest_marker("per_call") is not None:
        given = os.environ.get("OXYGEN_CONF", "")
        monkeypatch.setenv("OXYGEN_CONF", ",".join(filter(None, [given, "scheduler.engine:false"])))


@pytest.fixture
def device():
    """The device GPU-capable tests run on: cuda where there is one, else cpu."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def fresh_compile():
    """A fresh dynamo and fresh oxygen_torch.compile.stats() around a compile test."""
    import oxygen_torch.compile as oc

    torch._dynamo.reset()
    oc.reset_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def oxygen():
    """A test that applies oxygen to transformers models: warnings said once are said again
    for it, and afterwards the models get stock attention back and the KV pools go (with their
    prefix caches and CPU tiers: a later test sizes its own), so no test sees another's pools
    (files that need more define their own `oxygen`)."""
    from oxygen_torch import _patching
    from oxygen_torch.integrations.hf import integration as hf
    from oxygen_torch.integrations.hf import prefix as hf_prefix

    _patching.forget_warnings()
    yield
    hf_prefix.clear()
    # disable_hf() ends in release_pools(), which collects caches left in reference cycles
    # first (their blocks come back, else a pool stays busy) and again after letting go: a
    # full collection takes ~0.25 s with torch and transformers loaded, and this teardown once
    # made five of them
    hf.disable_hf()
