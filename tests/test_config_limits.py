"""Limits on every size in the configuration, errors that name the right field, a strict YAML
reader, pool.backend=cuda without a GPU, and the warning for fields that do nothing yet."""

import logging
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oxygen_torch
from oxygen_torch import config
from oxygen_torch.config import ENV_CONF, ENV_FILE, KVConfig, PoolConfig, load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats as kv_pool_stats
from oxygen_torch.kv.pool import release_pools

HUGE = 10**5000  # Python refuses to turn this into text: messages must not try


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_CONF, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setattr(config.sources, "_warned_not_wired", set())
    yield
    oxygen_torch.disable()


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("page_size", 1 << 64, r"pool.page_size: 18446744073709551616 \(16777216 TiB\) is out of"),
        ("page_size", 1e300, "pool.page_size: an integer of 997 bits .* is out of range"),
        ("page_size", "1TiB", r"pool.page_size: 1099511627776 \(1 TiB\) is out of range; "),
        ("page_size", HUGE, "pool.page_size: an integer of 16610 bits"),
        ("cpu_tier_bytes", 1 << 64, "pool.cpu_tier_bytes: .* is out of range; allowed: 0 to this"),
        ("arena_bytes", 1 << 64, "kv.arena_bytes: .* is out of range; allowed: 0 .auto. to"),
        ("arena_bytes", HUGE, "kv.arena_bytes: an integer of 16610 bits"),
        ("prefill_chunk_tokens", 1 << 80, "kv.prefill_chunk_tokens: .* out of range; allowed: 0"),
        ("block_tokens", HUGE, "kv.block_tokens: an integer of 16610 bits .* is not allowed"),
        ("prefetch_distance", HUGE, "kv.prefetch_distance: an integer of 16610 bits"),
        ("block_m", HUGE, "kernel.block_m: an integer of 16610 bits"),
        ("hysteresis_ms", HUGE, "pool.hysteresis_ms: .* is not a number"),
        ("decode_prefill_tokens", -1, "scheduler.decode_prefill_tokens: -1 is out of range"),
        ("decode_prefill_tokens", 1 << 21, "scheduler.decode_prefill_tokens: 2097152 is out of"),
    ],
    ids=lambda v: "5000-digits" if v is HUGE else None,
)
def test_absurd_sizes_are_refused_naming_the_field(key, value, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(**{key: value})


def test_page_size_of_a_tebibyte_fails_at_enable_naming_pool_page_size(monkeypatch):
    """It used to pass validation and fail at generate(), blaming kv.arena_bytes."""
    monkeypatch.setenv(ENV_CONF, "page_size:1TiB")
    with pytest.raises(ValueError, match="pool.page_size: .* allowed: a multiple of 2 MiB up to"):
        oxygen_torch.enable()
    assert not oxygen_torch.is_enabled()
    assert load_config(page_size="1GiB").pool.page_size == 1 << 30  # the largest allowed


def _llama(layers):
    import transformers as T

    torch.manual_seed(0)
    conf = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = T.LlamaForCausalLM(conf).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _generate(model):
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize(
    "layers, cfg, needle",
    [  # the host arena is 4 GiB when kv.arena_bytes is 0 (auto): 4 layers' K and V need 8 GiB
        (4, dict(page_size="1GiB"), r"pool.page_size: 1073741824 \(1 GiB\) is too large for the"
         r" KV arena: its 4 layers' K and V take 8 pages at least \(8589934592 \(8 GiB\)\), and "
         r"the arena holds 4294967296 \(4 GiB\) \(kv.arena_bytes, or its default when 0\); lower"
         r" pool.page_size \(the default is 2097152 \(2 MiB\)\) or raise kv.arena_bytes to ≥ "
         r"8589934592$"),
        # (the arena rounds 64 MiB up to a page)
        (2, dict(page_size="1GiB", arena_bytes="64MiB"), r"pool.page_size: 1073741824 \(1 GiB\) "
         r"is too large for the KV arena: its 2 layers' .* the arena holds 1073741824 "),
        # the arena is too small at any page size: kv.arena_bytes caused it
        (4, dict(arena_bytes="4MiB"), r"kv.arena_bytes: 4194304 \(4 MiB\) holds no block for 4 "
         r"layers x 2048 bytes per block \(need ≥ 16777216 \(16 MiB\) with pool.page_size = "
         r"2097152 \(2 MiB\)\)$"),
    ],
)  # fmt: skip
def test_an_arena_that_holds_no_block_names_the_field_that_caused_it(layers, cfg, needle):
    """pool.page_size = 1 GiB failed at generate() naming only kv.arena_bytes, which the user
    never set."""
    model = hf.apply(_llama(layers), load_config(**cfg))
    try:
        with pytest.raises(ValueError, match=needle):
            _generate(model)
    finally:
        hf.disable_hf()
        release_pools()


@pytest.mark.parametrize("layers, page", [(2, "1GiB"), (4, "64MiB")])
def test_large_pages_that_fit_the_arena_give_stock_tokens(layers, page):
    want = _generate(_llama(layers))
    model = hf.apply(_llama(layers), load_config(page_size=page))
    try:
        assert torch.equal(_generate(model), want)
        (pool,) = kv_pool_stats()
        size = load_config(page_size=page).pool.page_size
        assert pool["mapped_bytes"] > 0 and pool["mapped_bytes"] % size == 0  # pages of `page`
    finally:
        hf.disable_hf()
        release_pools()


def test_cpu_tier_is_bounded_by_this_machines_memory():
    ram = config.host_memory_bytes()
    assert PoolConfig(cpu_tier_bytes=ram).cpu_tier_bytes == ram
    with pytest.raises(ValueError, match="pool.cpu_tier_bytes: .* this machine's memory"):
        PoolConfig(cpu_tier_bytes=ram + 1)


@pytest.mark.parametrize("where", ["env", "yaml"])
def test_5000_digit_integers_name_the_field(where, monkeypatch, tmp_path):
    digits = "9" * 5000
    if where == "env":
        monkeypatch.setenv(ENV_CONF, f"kv.arena_bytes:{digits}")
    else:
        f = tmp_path / "c.yaml"
        f.write_text(f"kv:\n  arena_bytes: {digits}\n")
        monkeypatch.setenv(ENV_FILE, str(f))
    with pytest.raises(ValueError, match="kv.arena_bytes: an integer of 5000 digits") as info:
        load_config()
    if where == "yaml":
        assert str(tmp_path / "c.yaml") in str(info.value) and ENV_FILE in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["page_size", "cpu_tier_bytes", "arena_bytes", "prefill_chunk_tokens"]),
    st.one_of(st.integers(), st.integers(-(1 << 70), 1 << 70).map(lambda n: n * (1 << 21))),
)
def test_any_integer_gives_a_valid_config_or_names_its_field(key, n):
    try:
        cfg = load_config(**{key: n})
    except ValueError as exc:
        assert key in str(exc) and len(str(exc)) < 400
    else:
        assert cfg.as_dict()[next(k for k in cfg.as_dict() if k.endswith("." + key))] == n
        assert 0 <= n < 1 << 48


@pytest.mark.parametrize(
    "text, needle",
    [
        ("pool:\n  page_size: 2MiB\n  page_size: 4MiB\n", r"key 'page_size' is given twice"),
        ("kv:\n  block_tokens: 32\nkv:\n  block_tokens: 64\n", r"key 'kv' is given twice"),
        ("1: 2\n", "configuration key 1 is not a name"),
        ("pool: 5\n", "configuration section 'pool' must be a mapping of its fields, got 5"),
    ],
)
def test_yaml_file_is_read_strictly(text, needle, monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    monkeypatch.setenv(ENV_FILE, str(f))
    with pytest.raises(ValueError, match=needle) as info:
        load_config()
    assert str(f) in str(info.value)


def test_yaml_merge_keys_are_not_duplicates(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kv:\n  <<: {block_tokens: 32}\n  block_tokens: 64\n")
    monkeypatch.setenv(ENV_FILE, str(f))
    assert load_config().kv.block_tokens == 64


def test_non_utf8_yaml_names_the_file_and_the_variable(monkeypatch, tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("pool:\n  backend: h\xf4st\n".encode("latin-1"))
    monkeypatch.setenv(ENV_FILE, str(f))
    with pytest.raises(ValueError) as info:
        load_config()
    msg = str(info.value)
    assert msg.startswith(f"{ENV_FILE}: {str(f)!r} is not UTF-8 text (byte 18")
    assert "must be YAML in UTF-8" in msg


def _load_config_on_a_thread(monkeypatch, path, timeout=20):
    """load_config() with OXYGEN_CONFIG_FILE = path on a thread: its exception, or a failure when
    it did not finish within `timeout` seconds (a reader blocked on a FIFO is let go first)."""
    monkeypatch.setenv(ENV_FILE, str(path))
    out = []

    def load():
        try:
            load_config()
            out.append(None)
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open() returns
        t.join(5)
        pytest.fail(f"load_config() did not finish in {timeout} s reading {path}")
    return out[0]


def test_config_file_that_is_a_fifo_or_a_directory_is_refused_at_once(monkeypatch, tmp_path):
    """A FIFO hung load_config() (open() waits for a writer)."""
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory")):
        t0 = time.monotonic()
        exc = _load_config_on_a_thread(monkeypatch, path)
        assert time.monotonic() - t0 < 5
        assert isinstance(exc, ValueError), exc
        assert str(exc).startswith(f"{ENV_FILE}: {str(path)!r} is {kind}, not a regular file")


def test_config_file_larger_than_the_bound_is_refused(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    mib = 1 << 20  # the bound
    f.write_bytes(b"#" * mib + b"\n")
    exc = _load_config_on_a_thread(monkeypatch, f)
    assert isinstance(exc, ValueError), exc
    assert str(exc).startswith(f"{ENV_FILE}: {str(f)!r} holds {mib + 1} bytes, more than")
    assert "1 MiB" in str(exc)
    body = b"kv:\n  block_tokens: 32\n"
    f.write_bytes(b"#" * (mib - len(body) - 1) + b"\n" + body)
    monkeypatch.setenv(ENV_FILE, str(f))
    assert load_config().kv.block_tokens == 32  # up to the bound, read as usual


def test_config_file_dev_zero_is_refused_without_reading_it():
    """/dev/zero ended in MemoryError after reading what memory there was; here in a process
    whose address space is bounded (3 GiB), so a regression fails instead of filling memory."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from oxygen_torch.config import load_config\n"
        "try:\n    load_config()\nexcept BaseException as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, ENV_FILE: "/dev/zero", "PYTHONPATH": os.getcwd()}
    env.pop(ENV_CONF, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.stdout.startswith(
        f"ValueError {ENV_FILE}: '/dev/zero' is a character device, not a regular file"
    ), out.stdout + out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_backend_cuda_without_a_gpu_fails_clearly_auto_chooses_host():
    with pytest.raises(RuntimeError, match="pool.backend is 'cuda', but torch sees no usable"):
        oxygen_torch.enable(pool={"backend": "cuda"})
    assert not oxygen_torch.is_enabled()
    oxygen_torch.enable(pool={"backend": "auto"})
    assert oxygen_torch.memory_stats()["backend"] == "host"


def test_a_field_not_wired_yet_warns_once(caplog, monkeypatch):
    """The mechanism for a field documented ahead of its feature (none is now): a non-default
    value warns once, naming the field and what will read it; the default says nothing."""
    monkeypatch.setattr(config.sources, "NOT_WIRED", {"kv.prefetch_distance": "a later feature"})
    caplog.set_level(logging.WARNING, logger="oxygen_torch")
    load_config()  # defaults: silent
    load_config(prefetch_distance=0)  # the default, given: silent
    assert not [r for r in caplog.records if "has no effect yet" in r.getMessage()]
    load_config(prefetch_distance=2)
    oxygen_torch.enable(prefetch_distance=2)  # enable() reads through load_config: still once
    warned = [r.getMessage() for r in caplog.records if "has no effect yet" in r.getMessage()]
    assert warned == [
        "oxygen_torch: kv.prefetch_distance = 2 has no effect yet: it is used by a later feature"
    ]


def test_every_field_is_wired_prefetch_distance_included(caplog, monkeypatch, tmp_path):
    """kv.prefetch_distance is read by the engine's swap-in ahead: no source warns about it."""
    assert config.NOT_WIRED == {}
    caplog.set_level(logging.WARNING, logger="oxygen_torch")
    f = tmp_path / "c.yaml"
    f.write_text("kv:\n  prefetch_distance: 9\n")
    monkeypatch.setenv(ENV_FILE, str(f))
    assert load_config().kv.prefetch_distance == 9
    monkeypatch.delenv(ENV_FILE)
    monkeypatch.setenv(ENV_CONF, "kv.prefetch_distance:0")
    assert load_config().kv.prefetch_distance == 0
    assert load_config(prefetch_distance=3).kv.prefetch_distance == 3
    assert not [r for r in caplog.records if "has no effect yet" in r.getMessage()]
    assert KVConfig().prefetch_distance == 0  # the documented default: off


def test_scheduler_weights_are_wired_and_say_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="oxygen_torch")
    assert load_config(alpha=0.5, beta=0.2).scheduler.alpha == 0.5  # the WFQ policy reads them
    assert not [r for r in caplog.records if "has no effect yet" in r.getMessage()]


@pytest.mark.parametrize(
    "profile, needle",
    [
        ({"block_size": [HUGE, 64]}, "optimizations.llama.block_size: .* must be two integers"),
        ({"prefetch_distance": HUGE}, "optimizations.llama.prefetch_distance: an integer of"),
        ({"retention_priority_factor": float("inf")}, "must be a finite number"),
    ],
    ids=["block_size", "prefetch_distance", "retention"],
)
def test_profile_values_are_bounded_naming_the_key(profile, needle):
    from oxygen_torch.config.profiles import validate_profile

    with pytest.raises(ValueError, match=needle):
        validate_profile("llama", profile)
