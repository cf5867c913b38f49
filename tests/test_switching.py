"""The interpreter's switch interval while engine threads run (engine/switching.py): lowered to
scheduler.switch_interval_ms when longer, put back when the last engine thread ends, unless
someone set another meanwhile; 0 leaves it alone; a forked child gets the one from before."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from test_engine_errors import llama

import oxygen_torch
from oxygen_torch.config import SchedulerConfig
from oxygen_torch.engine import switching


def now_ms() -> float:
    return round(sys.getswitchinterval() * 1e3, 4)


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield
    while switching._holders:  # (a test that failed midway)
        switching.release()
    sys.setswitchinterval(before)


def test_the_last_release_puts_the_interval_back(interval):
    sys.setswitchinterval(0.004)
    switching.hold(0.1)
    assert now_ms() == 0.1 and switching.lowered() == pytest.approx(1e-4)
    switching.hold(0.1)  # a second engine
    switching.release()
    assert now_ms() == 0.1  # one engine still runs
    switching.release()
    assert now_ms() == 4.0 and switching.lowered() is None


def test_a_shorter_interval_stays_and_zero_changes_nothing(interval):
    sys.setswitchinterval(0.00005)
    switching.hold(0.1)
    assert now_ms() == 0.05
    switching.release()
    assert now_ms() == 0.05
    sys.setswitchinterval(0.004)
    switching.hold(0)
    assert now_ms() == 4.0
    switching.release()
    assert now_ms() == 4.0 and switching._holders == 0


def test_an_interval_set_meanwhile_is_not_undone(interval):
    sys.setswitchinterval(0.004)
    switching.hold(0.2)
    sys.setswitchinterval(0.002)  # the user's, while an engine runs
    switching.release()
    assert now_ms() == 2.0
    # ... and one set meanwhile and lowered again by a later engine comes back, not the first
    switching.hold(0.2)
    sys.setswitchinterval(0.003)
    switching.hold(0.2)
    switching.release()
    switching.release()
    assert now_ms() == 3.0


def test_a_forked_child_gets_the_interval_from_before(interval):
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    sys.setswitchinterval(0.004)
    switching.hold(0.1)
    try:
        pid = os.fork()
        if pid == 0:
            ok = now_ms() == 4.0 and switching.lowered() is None and switching._holders == 0
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert now_ms() == 0.1  # the parent's engines still run
    finally:
        switching.release()
    assert now_ms() == 4.0


@pytest.mark.parametrize("ms", [0.2, 0.0])
def test_the_engine_thread_holds_it_while_it_runs(oxygen, interval, ms):
    """An engine call lowers the interval while its thread lives (it stays a while idle);
    disable() ends the thread and the interval is the user's again. Tokens equal stock's."""
    sys.setswitchinterval(0.004)
    ids = torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(int(ms * 10)))
    kw = dict(max_new_tokens=5, do_sample=False)
    ref = llama().generate(ids, attention_mask=torch.ones_like(ids), **kw)
    oxygen_torch.enable(scheduler={"switch_interval_ms": ms})
    try:
        model = llama()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(out, ref)
        assert oxygen_torch.engine_stats(model)["steps"] > 0  # (the engine ran it)
        assert now_ms() == (ms or 4.0)
    finally:
        oxygen_torch.disable()
    assert now_ms() == 4.0 and switching._holders == 0


@pytest.mark.parametrize("bad", [-0.1, math.nan, 1000.5])
def test_an_interval_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"scheduler.switch_interval_ms: .* allowed: 0"):
        SchedulerConfig(switch_interval_ms=bad)
