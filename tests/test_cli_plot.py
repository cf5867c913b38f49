"""`python -m oxygen_torch plot`: the demo and a recorded script write a real PNG."""

import subprocess
import sys
import textwrap

import matplotlib.image
import pytest
import torch

from oxygen_torch.tools import cli_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.shape[0] >= 300 and img.shape[1] >= 800
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def run_plot(args, cwd, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "oxygen_torch", "plot", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_plot_demo_writes_a_png(tmp_path):
    r = run_plot(["--demo", str(tmp_path / "demo.png")], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrote" in r.stdout
    check_png(tmp_path / "demo.png")


SCRIPT = """
    import sys, time
    from oxygen_torch.tools import metrics
    from oxygen_torch.pool import VirtualPool

    pool = VirtualPool(backend="host", capacity=256 << 20)
    metrics.register_pool(pool, name="script")
    live = []
    for _ in range(12):
        live.append(pool.malloc(4 << 20))
        time.sleep(0.01)
    for p in live:
        pool.free(p)
    print("args", sys.argv[1:])
    sys.exit(int(sys.argv[1]))
"""


def test_plot_records_a_script_and_passes_its_exit_code(tmp_path):
    """A script that fails (exit 3): its code passed on, no chart (exit 0 with a chart: the
    bare script's test below)."""
    (tmp_path / "work.py").write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "work.png"
    r = run_plot(["-o", str(out), "--", sys.executable, "work.py", "3"], tmp_path)
    assert "args ['3']" in r.stdout  # the script ran with its arguments
    assert "Error in sitecustomize" not in r.stderr
    assert r.returncode == 3 and not out.exists()


def test_sampler_records_allocated_and_mapped(tmp_path):
    figures = iter([(1, 2), (3, 4)])
    sampler = cli_plot.Sampler(tmp_path / "t.tl", lambda: next(figures, (5, 6)), interval=0.001)
    sampler.sample()
    sampler.sample()
    sampler.stop()  # never started: stop still writes the final sample and closes
    t, alloc, mapped = cli_plot.load(tmp_path / "t.tl")
    assert alloc == [1, 3, 5] and mapped == [2, 4, 6] and t == sorted(t)


def test_plot_needs_demo_or_a_command(tmp_path):
    r = run_plot([], tmp_path, timeout=60)
    assert r.returncode == 2 and "either --demo or a command" in r.stderr


@pytest.mark.parametrize("where", ["missing-dir/out.png", "a-directory", "/proc/oxygen.png"])
def test_unwritable_output_is_a_message_not_a_traceback(tmp_path, where):
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "work.py").write_text("print('ran')\n")
    r = run_plot(["-o", where, "--", sys.executable, "work.py"], tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and f"plot: cannot write the chart to {where}: " in r.stderr
    assert "ran" not in r.stdout  # refused before the script ran, not after


def test_missing_command_is_a_message_not_a_traceback(tmp_path):
    r = run_plot(["--", "no-such-command-oxygen", "x"], tmp_path, timeout=60)
    assert r.returncode == 127 and "Traceback" not in r.stderr
    assert "plot: cannot run 'no-such-command-oxygen': No such file or directory" in r.stderr


def test_a_bare_script_runs_with_this_python(tmp_path):
    """A script named without an interpreter runs with this one, its arguments passed, and
    its allocations are charted."""
    (tmp_path / "work.py").write_text(textwrap.dedent(SCRIPT))
    r = run_plot(["-o", "w.png", "--", "work.py", "0"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "args ['0']" in r.stdout and "Error in sitecustomize" not in r.stderr
    check_png(tmp_path / "w.png")


CPU_ONLY = """
    import torch
    x = [torch.ones(1 << 20) for _ in range(8)]  # CPU tensors: PyTorch's CPU allocator
    print("sum", int(sum(t.sum() for t in x)))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cpu_script_says_cpu_tensors_do_not_go_through_the_pool(tmp_path):
    (tmp_path / "cpu.py").write_text(textwrap.dedent(CPU_ONLY))
    r = run_plot(["-o", "cpu.png", "--", sys.executable, "cpu.py"], tmp_path)
    assert "sum 8388608" in r.stdout  # the script itself ran
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nothing went through oxygen_torch's pool" in r.stderr
    assert "CPU tensors do not go through the pool" in r.stderr
    assert not (tmp_path / "cpu.png").exists()
