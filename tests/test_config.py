"""Configuration: defaults, precedence, validation, parsing (with hypothesis fuzzing)."""

import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oxygen_torch
from oxygen_torch.config import (
    ENV_CONF,
    ENV_FILE,
    KernelConfig,
    KVConfig,
    PoolConfig,
    SchedulerConfig,
    load_config,
    parse_conf_string,
)
from oxygen_torch.config.profiles import get_profile, nearest_pow2


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_CONF, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    yield
    oxygen_torch.disable()


def test_documented_defaults():
    cfg = load_config()
    assert cfg.pool.page_size == 2 << 20
    assert cfg.pool.hot_zone_ratio == 0.6
    assert cfg.pool.migration_threshold == 0.8
    assert cfg.pool.backend == "auto"
    assert cfg.kv.prefetch_distance == 0  # swap-ins ahead: opt-in
    assert cfg.kv.kv_dtype == "auto"
    assert cfg.kv.cpu_decode_graphs == "off"  # decode graphs on a GPU only
    assert cfg.kernel.precision is oxygen_torch.PrecisionMode.AUTO_MIXED
    assert cfg.kernel.attention_type == "dense"
    assert (cfg.scheduler.alpha, cfg.scheduler.beta) == (0.7, 0.3)
    assert cfg.sources == {}


def test_precision_mode_values():
    pm = oxygen_torch.PrecisionMode
    assert (pm.FP16_ONLY, pm.AUTO_MIXED, pm.FP32_SAFE) == (0, 1, 2)
    assert pm.parse("fp32_safe") is pm.FP32_SAFE
    assert pm.parse(0) is pm.FP16_ONLY
    with pytest.raises(ValueError, match="precision"):
        pm.parse("fp64")


def test_precedence_kwargs_over_env_over_file(tmp_path, monkeypatch):
    f = tmp_path / "oxygen.yaml"
    f.write_text(
        "pool:\n  hot_zone_ratio: 0.3\n  migration_threshold: 0.7\nkv:\n  block_tokens: 64\n"
    )
    monkeypatch.setenv(ENV_FILE, str(f))
    monkeypatch.setenv(ENV_CONF, "pool.hot_zone_ratio:0.4,prefetch_distance:8")
    cfg = load_config(hot_zone_ratio=0.5)
    assert cfg.pool.hot_zone_ratio == 0.5
    assert cfg.pool.migration_threshold == 0.7
    assert cfg.kv.block_tokens == 64
    assert cfg.kv.prefetch_distance == 8
    assert cfg.sources["pool.hot_zone_ratio"] == "enable()"
    assert cfg.sources["kv.prefetch_distance"] == ENV_CONF
    assert cfg.sources["pool.migration_threshold"] == f"file:{f}"


def test_env_parsing_types_and_sizes():
    got = parse_conf_string(
        "page_size:4MiB, kernel.precision:fp32_safe,block_m:none,debug_checks:true"
    )
    assert got == {
        "pool.page_size": 4 << 20,
        "kernel.precision": oxygen_torch.PrecisionMode.FP32_SAFE,
        "kernel.block_m": None,
        "kv.debug_checks": True,
    }


@pytest.mark.parametrize(
    "conf, needle",
    [
        ("hot_zone_ratio:1.5", "pool.hot_zone_ratio: 1.5 is out of range"),
        ("hot_zone_ratio:0", "pool.hot_zone_ratio: 0.0 is out of range"),
        ("migration_threshold:nan", "pool.migration_threshold"),
        ("page_size:3MiB", "pool.page_size: 3145728 is not a positive multiple"),
        ("page_size:abc", "pool.page_size: ' abc'|pool.page_size: 'abc'"),
        ("nonsense:1", "unknown configuration key 'nonsense'"),
        ("pool.nonsense:1", "unknown configuration key 'pool.nonsense'"),
        ("gpu.page_size:1", "unknown configuration section 'gpu'"),
        ("block_tokens:24", "kv.block_tokens: 24 is not allowed"),
        ("kv_dtype:int4", "kv.kv_dtype: 'int4' is not allowed"),
        ("backend:rocm", "pool.backend: 'rocm' is not allowed"),
        ("cpu_decode_graphs:on", "kv.cpu_decode_graphs: 'on' is not allowed; allowed: off, rerun"),
        ("block_n:96", "kernel.block_n: 96 is not allowed"),
        ("precision:fast", "precision: 'fast' is not a precision mode"),
        ("alpha:2", "scheduler.alpha: 2.0 is out of range"),
        ("hot_zone_ratio", "is not of the form key:value"),
        ("alpha:0.1,alpha:0.2", "given twice"),
    ],
)
def test_bad_env_values_name_the_field(monkeypatch, conf, needle):
    monkeypatch.setenv(ENV_CONF, conf)
    with pytest.raises(ValueError, match=needle):
        load_config()


def test_bad_kwargs_and_direct_construction():
    with pytest.raises(ValueError, match="pool.reserve_fraction"):
        load_config(reserve_fraction=-0.1)
    with pytest.raises(ValueError, match="unknown configuration key 'hot_zone'"):
        load_config(hot_zone=0.1)
    with pytest.raises(ValueError, match="pool.page_size: '2MiB' has the wrong type"):
        PoolConfig(page_size="2MiB")
    with pytest.raises(ValueError, match="kv.debug_checks"):
        KVConfig(debug_checks="yes")
    assert load_config(pool={"backend": "host"}).pool.backend == "host"
    with pytest.raises(ValueError, match=r"pool.hysteresis_ms: 0(\.0)? is out of range"):
        load_config(hysteresis_ms=0)
    with pytest.raises(ValueError, match="kv.prefill_chunk_tokens: -1 is negative"):
        load_config(prefill_chunk_tokens=-1)
    assert load_config(hysteresis_ms=20).pool.hysteresis_ms == 20
    assert load_config(kernel=KernelConfig(block_m=32)).kernel.block_m == 32
    assert load_config(kernel__block_n=64).kernel.block_n == 64
    assert load_config(decode_balance=True).kernel.decode_balance is True
    with pytest.raises(ValueError, match="kernel.decode_balance: true with scheduler.max_step_"):
        load_config(decode_balance=True, max_step_seqs=5000)
    assert load_config(decode_balance=True, max_step_seqs=4096).scheduler.max_step_seqs == 4096
    from oxygen_torch.triton_kernels.paged_decode import MAX_BALANCED_BATCH

    assert MAX_BALANCED_BATCH == 4096  # (the configuration's check holds the kernel's bound)
    with pytest.raises(ValueError, match="kernel.decode_balance"):
        KernelConfig(decode_balance="yes")
    assert SchedulerConfig(alpha=1, beta=0).alpha == 1


@pytest.mark.parametrize("kernel", ["fused", "fast"])
def test_sampling_kernel_is_torch_or_topk(kernel):
    """scheduler.sampling_kernel: "torch" or "topk" (the default). Anything else, "fused" too
    (a one-kernel variant measured slower than both and removed), is refused naming the field
    and the values allowed."""
    assert SchedulerConfig().sampling_kernel == "topk"
    assert load_config(scheduler={"sampling_kernel": "torch"}).scheduler.sampling_kernel == "torch"
    want = rf"scheduler\.sampling_kernel: '{kernel}' is not allowed; allowed: torch, topk$"
    with pytest.raises(ValueError, match=want):
        load_config(scheduler={"sampling_kernel": kernel})


def test_yaml_file_errors(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("pool: [1, 2\n")
    monkeypatch.setenv(ENV_FILE, str(f))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config()
    f.write_text("- 1\n")
    with pytest.raises(ValueError, match="mapping at the top level"):
        load_config()
    f.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ValueError, match="not valid YAML"):  # safe_load refuses to build objects
        load_config()
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="cannot read"):
        load_config()


def test_llama_profile_rounds_with_one_warning(caplog, tmp_path, monkeypatch):
    from oxygen_torch.config import profiles

    # (the once-only set starts empty here whatever ran before: test_ops rounds 96 too)
    monkeypatch.setattr(profiles, "_warned", set())
    caplog.set_level(logging.WARNING, logger="oxygen_torch")
    prof = get_profile("llama")
    assert (prof.block_m, prof.block_n) == (None, None)  # measured: the adaptive tiles win
    assert prof.prefetch_distance == 4
    assert prof.retention_priority(10) == pytest.approx(8.0)
    given = {"llama": {"block_size": [96, 96]}}  # the seed's, from a user's file
    prof = get_profile("llama", given)
    assert (prof.block_m, prof.block_n) == (64, 64)
    get_profile("llama", given)
    # one warning per (model, value), however often the profile is looked up
    assert sum("powers of two" in r.getMessage() for r in caplog.records) == 1
    assert get_profile("gpt2").block_m is None
    f = tmp_path / "c.yaml"
    f.write_text(
        "optimizations:\n  mistral:\n    block_size: [128, 32]\n    prefetch_distance: 2\n"
    )
    monkeypatch.setenv(ENV_FILE, str(f))
    cfg = load_config()
    p = get_profile("mistral", cfg.profiles)
    assert (p.block_m, p.block_n, p.prefetch_distance) == (128, 32, 2)
    f.write_text("optimizations:\n  llama:\n    tile: [1, 2]\n")
    with pytest.raises(ValueError, match="optimizations.llama: unknown key 'tile'"):
        load_config()


@given(st.integers(min_value=1, max_value=1 << 20))
def test_nearest_pow2(n):
    p = nearest_pow2(n)
    assert p & (p - 1) == 0
    assert abs(p - n) <= abs(2 * p - n) and (p == 1 or abs(p - n) <= abs(p // 2 - n))


def test_enable_twice_and_disable():
    cfg = oxygen_torch.enable(hot_zone_ratio=0.5)
    assert oxygen_torch.is_enabled() and oxygen_torch.active_config() == cfg
    assert oxygen_torch.enable(hot_zone_ratio=0.5) is cfg
    with pytest.raises(ValueError, match=r"pool.hot_zone_ratio: 0.5 now, 0.4 asked"):
        oxygen_torch.enable(hot_zone_ratio=0.4)
    oxygen_torch.disable()
    assert not oxygen_torch.is_enabled()
    oxygen_torch.disable()  # no-op
    with pytest.raises(ValueError, match="pool.hot_zone_ratio"):
        oxygen_torch.enable(hot_zone_ratio=2.0)
    assert not oxygen_torch.is_enabled()


# --- fuzzing -------------------------------------------------------------------------------------

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_text)
def test_parser_never_crashes_on_garbage(text):
    """Any string: either a parsed dict or a ValueError — never another exception."""
    try:
        parse_conf_string(text)
    except ValueError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_ratio_validator(x):
    ok = 0.0 < x <= 1.0 and not math.isnan(x)
    try:
        PoolConfig(hot_zone_ratio=x, migration_threshold=1.0)  # (the ratio may not pass it)
        assert ok
    except ValueError as exc:
        assert not ok and "pool.hot_zone_ratio" in str(exc)


def test_hot_zone_ratio_may_not_pass_the_migration_threshold():
    assert PoolConfig(hot_zone_ratio=0.8, migration_threshold=0.8).hot_zone_ratio == 0.8
    with pytest.raises(ValueError, match=r"pool.hot_zone_ratio: 0.9 is above pool.migration_thr"):
        PoolConfig(hot_zone_ratio=0.9)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(1 << 40), max_value=1 << 40))
def test_block_tokens_validator(n):
    ok = 16 <= n <= 256 and n & (n - 1) == 0
    try:
        KVConfig(block_tokens=n)
        assert ok
    except ValueError as exc:
        assert not ok and "kv.block_tokens" in str(exc)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["hot_zone_ratio", "block_tokens", "alpha", "backend", "precision"]),
        st.one_of(st.integers(-5, 300), st.floats(-1, 2), st.sampled_from(["host", "auto", "x"])),
        max_size=4,
    )
)
def test_env_roundtrip_values_are_validated(values):
    """Whatever OXYGEN_CONF says, load_config returns a valid config or names the bad field."""
    import os

    text = ",".join(f"{k}:{v}" for k, v in values.items())
    os.environ[ENV_CONF] = text
    try:
        cfg = load_config()
    except ValueError as exc:
        assert any(k in str(exc) for k in values)
    else:
        parsed = parse_conf_string(text)
        flat = cfg.as_dict()
        assert all(flat[key] == value for key, value in parsed.items())
    finally:
        del os.environ[ENV_CONF]
