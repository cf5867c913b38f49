"""The native library: loading, the host backend life cycle, and errors without a driver."""

import os
import subprocess
import sys

import pytest
from test_pool_fork import host_mappings

from oxygen_torch.pool import native as _native

HAS_DRIVER = True
try:
    _native.cuda_probe()
except _native.NativeError:
    HAS_DRIVER = False


def test_library_loads_and_reports_version():
    assert _native.version() == "0.1.0"


def test_host_backend_selftest_round_trip():
    assert _native.backend_selftest("host", page_size=2 << 20) == 2 << 20
    assert _native.backend_selftest("host", page_size=4 << 20) == 4 << 20


def test_host_backend_rejects_bad_page_size():
    with pytest.raises(_native.NativeError, match="invalid argument: host backend: page size"):
        _native.backend_selftest("host", page_size=1000)


@pytest.mark.parametrize(
    "handle_mib,total_mib,each", [(2, 16, False), (4, 24, True), (8, 8, False)]
)
def test_host_map_probe_times_every_call_and_leaves_nothing_mapped(handle_mib, total_mib, each):
    before = host_mappings()
    r = _native.backend_map_probe("host", handle_mib << 20, total_mib << 20, access_each=each)
    assert tuple(r) == _native.MAP_PROBE_CALLS
    assert all(0 < v < 10 for v in r.values()), r
    assert host_mappings() == before  # every handle unmapped and released, the range freed


@pytest.mark.parametrize("handle,total", [(3 << 20, 6 << 20), (4 << 20, 6 << 20), (0, 4 << 20),
                                          (2 << 20, 0)])  # fmt: skip
def test_host_map_probe_refuses_sizes_off_the_granularity(handle, total):
    with pytest.raises(_native.NativeError, match="multiple of the backend's granularity"):
        _native.backend_map_probe("host", handle, total)


@pytest.mark.cuda
def test_cuda_map_probe_times_every_call():
    r = _native.backend_map_probe("cuda", 32 << 20, 256 << 20)
    assert all(0 < v < 10 for v in r.values()), r


@pytest.mark.skipif(HAS_DRIVER, reason="checks the no-driver path")
def test_no_driver_is_a_clear_error():
    with pytest.raises(_native.NativeError) as info:
        _native.cuda_probe()
    assert info.value.status == _native.ERR_NO_DRIVER
    assert "libcuda.so.1" in str(info.value)
    with pytest.raises(_native.NativeError, match="no CUDA driver"):
        _native.backend_selftest("cuda")


def test_missing_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_native, "LIB_PATH", tmp_path / "_oxygen.so")
    _native.lib.cache_clear()
    try:
        with pytest.raises(_native.NativeLibraryError, match="native library is missing"):
            _native.lib()
    finally:
        monkeypatch.undo()
        _native.lib.cache_clear()
    assert _native.version() == "0.1.0"


@pytest.mark.cuda
def test_cuda_device_reports_2mib_granularity():
    info = _native.cuda_device_info(0)
    assert info["vmm_supported"]
    assert info["granularity"] == 2 << 20
    assert _native.backend_selftest("cuda", 0) == 2 << 20


def _doctor(oxygen_conf: str | None = None) -> subprocess.CompletedProcess:
    """`python -m oxygen_torch doctor` in a fresh process, with OXYGEN_CONF set if given."""
    env = dict(os.environ)
    env.pop("OXYGEN_CONF", None)
    if oxygen_conf is not None:
        env["OXYGEN_CONF"] = oxygen_conf
    return subprocess.run(
        [sys.executable, "-m", "oxygen_torch", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_runs_and_exits_zero():
    r = _doctor()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "usable: yes" in r.stdout
    assert "host backend   : reserve/create/map/access/unmap/release OK" in r.stdout
    if not HAS_DRIVER:
        assert "CPU paths" in r.stdout


def test_doctor_fails_clearly_on_bad_config():
    r = _doctor("hot_zone_ratio:7")
    assert r.returncode == 1
    assert "NOT USABLE" in r.stdout and "pool.hot_zone_ratio: 7.0 is out of range" in r.stdout


def test_doctor_reports_sources_of_non_defaults():
    r = _doctor("kv.block_tokens:32")
    assert "kv.block_tokens              32  (from OXYGEN_CONF)" in r.stdout


@pytest.mark.skipif(HAS_DRIVER, reason="checks the no-driver path")
def test_doctor_fails_when_cuda_is_forced_without_driver():
    r = _doctor("pool.backend:cuda")
    assert r.returncode == 1 and "cuda backend does not work here" in r.stdout
