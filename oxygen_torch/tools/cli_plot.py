"""python -m oxygen_torch plot [--demo] [-o OUT.png] [--compare] [-- python my_script.py ...]

Records allocated vs mapped bytes over time while a script (or the built-in demo) runs, and draws
them into one PNG: "where did my memory go". With ``--compare`` the same work runs a second time
in another process on PyTorch's default CUDA allocator (allocated vs reserved).

How a script is recorded without changing it: the child gets a ``sitecustomize.py`` on its
PYTHONPATH that loads this file and starts a sampler thread; the sampler writes ``t allocated
mapped`` lines to a file. The top-level imports here are standard library only, so that the
sampler adds nothing to the child's start-up (torch is read only once the script imported it).
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV_PATH, ENV_SOURCE, ENV_INTERVAL = (
    "OXYGEN_TIMELINE",
    "OXYGEN_TIMELINE_SOURCE",
    "OXYGEN_TIMELINE_DT",
)
MiB = 1 << 20
_SITECUSTOMIZE = """\
import importlib.machinery as _mach, importlib.util as _u, sys as _s
_spec = _u.spec_from_file_location("_oxygen_timeline", {path!r})
_m = _u.module_from_spec(_spec)
_spec.loader.exec_module(_m)
_m.start_from_env()
# Chain to the sitecustomize this one shadows, if there is one.
_other = _mach.PathFinder.find_spec("sitecustomize", [p for p in _s.path if p != {dir!r}])
if _other is not None:
    _other.loader.exec_module(_u.module_from_spec(_other))
"""


class Sampler:
    """Writes ``t allocated mapped`` every ``interval`` seconds from a daemon thread."""

    def __init__(self, path: str | os.PathLike, read, interval: float = 0.005):
        self.read, self.interval = read, interval
        self._file = open(path, "w", buffering=1)  # line-buffered: the parent counts lines live
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="oxygen-timeline", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        point = self.read()
        if point is not None and not self._file.closed:
            self._file.write(f"{time.monotonic() - self._t0:.4f} {point[0]} {point[1]}\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # the program may be tearing down; a lost sample is harmless
                pass

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        self.sample()
        self._file.close()


def reader(source: str):
    """(allocated, mapped) of oxygen's pools, or of PyTorch's CUDA allocator (allocated,
    reserved); None until the program has imported what is read, so nothing is imported early."""

    def read():
        if source == "oxygen" and "oxygen_torch" in sys.modules:
            from oxygen_torch.tools import metrics

            return metrics.pool_totals()
        torch = sys.modules.get("torch")
        if source == "torch" and torch is not None and torch.cuda.is_initialized():
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        return None

    return read


def start_from_env() -> Sampler | None:
    """Called by the child's sitecustomize: record to $OXYGEN_TIMELINE, then forget the variables
    so that the program's own child processes do not write to the same file."""
    path = os.environ.pop(ENV_PATH, None)
    source = os.environ.pop(ENV_SOURCE, "oxygen")
    interval = float(os.environ.pop(ENV_INTERVAL, "0.005"))
    if not path:
        return None
    if source == "oxygen":
        import oxygen_torch  # the recorded run is oxygen's: switch it on before the script runs

        oxygen_torch.enable()
    sampler = Sampler(path, reader(source), interval).start()
    atexit.register(sampler.stop)
    return sampler


def record(cmd: list[str], path: Path, source: str, interval: float, label: str) -> int:
    """Run ``cmd`` with the sampler injected; shows progress (samples so far) while it runs."""
    shim = Path(tempfile.mkdtemp(prefix="oxygen-plot-"))
    (shim / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(path=str(Path(__file__).resolve()), dir=str(shim))
    )
    pkg_parent = str(Path(__file__).resolve().parent.parent)  # the child uses this oxygen_torch
    env = dict(os.environ, **{ENV_PATH: str(path), ENV_SOURCE: source})
    env[ENV_INTERVAL] = str(interval)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(shim), pkg_parent, os.environ.get("PYTHONPATH", "")] if p
    )
    proc = subprocess.Popen(cmd, env=env)  # FileNotFoundError / PermissionError: see plot()
    _watch(proc, path, label)
    return proc.returncode


def _watch(proc: subprocess.Popen, path: Path, label: str) -> None:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the `ops` extra; without it, just wait
        proc.wait()
        return
    with tqdm(desc=f"recording {label}", unit=" samples", file=sys.stderr, leave=False) as bar:
        while proc.poll() is None:
            time.sleep(0.2)
            n = sum(1 for _ in open(path)) if path.exists() else 0
            bar.update(n - bar.n)


def load(path: Path) -> tuple[list[float], list[int], list[int]]:
    t, alloc, mapped = [], [], []
    for line in Path(path).read_text().splitlines():
        a, b, c = line.split()
        t.append(float(a))
        alloc.append(int(b))
        mapped.append(int(c))
    return t, alloc, mapped


def draw(runs: list[tuple[str, Path]], out: Path) -> None:
    """One panel per run, same y scale: allocated (solid), mapped (dashed), the gap shaded."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.6 * len(runs)), sharey=True)
    for ax, (label, path) in zip(list(getattr(axes, "flat", [axes])), runs):
        t, alloc, mapped = load(path)
        a = [x / MiB for x in alloc]
        m = [x / MiB for x in mapped]
        ax.fill_between(t, a, m, color="tab:red", alpha=0.15, label="held but not allocated")
        ax.plot(t, a, color="tab:blue", label="allocated")
        ax.plot(t, m, color="tab:red", linestyle="--", label=_held_name(label))
        pa, pm = max(alloc, default=0), max(mapped, default=0)
        frag = 1 - pa / pm if pm else 0.0
        ax.set_title(
            f"{label}: peak allocated {pa / MiB:.0f} MiB, peak {_held_name(label)} "
            f"{pm / MiB:.0f} MiB, 1 - peak allocated / peak held = {frag:.1%}"
        )
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
    list(getattr(axes, "flat", [axes]))[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _held_name(label: str) -> str:
    return "reserved" if label.startswith("PyTorch") else "mapped"


# ---------------------------------------------------------------------------------------------
# The built-in demo: a generate()-like allocation pattern.


def generate_pattern(alloc, free, unit: int, requests: int = 6, steps: int = 48, pause=0.003):
    """Requests of random batch and prompt length: prefill activations, then per decode step a
    KV buffer one token longer copied from the last (HF's dynamic cache grows by torch.cat) and
    a few temporaries. ``unit`` is the KV bytes per token and sequence."""
    rng = random.Random(0)
    bar = _progress(requests * steps)
    for _ in range(requests):
        batch, tokens = rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([64, 128, 256])
        act = alloc(batch * tokens * unit * 4)
        kv = alloc(batch * tokens * unit)
        free(act)
        del act
        for _ in range(steps):
            tokens += 1
            grown = alloc(batch * tokens * unit)
            free(kv)
            kv = grown
            temps = [alloc(batch * unit * rng.choice([2, 3, 5, 8])) for _ in range(3)]
            for t in temps:
                free(t)
            del temps, grown
            time.sleep(pause)
            if bar is not None:
                bar.update(1)
        free(kv)
        del kv
    if bar is not None:
        bar.close()


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="demo decode steps", file=sys.stderr, leave=False)


def demo_child(source: str, path: str, interval: float) -> None:
    """Runs in the recorded process. CUDA: the global pool (``enable()``) or PyTorch's default
    allocator. CPU: a host-backend VirtualPool (there is no default-allocator twin on CPU)."""
    import torch

    from oxygen_torch.tools import metrics

    if torch.cuda.is_available():
        if source == "oxygen":
            import oxygen_torch

            oxygen_torch.enable()
        read = metrics.pool_totals if source == "oxygen" else reader("torch")
        alloc = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")
        free, unit = (lambda t: None), 256 << 10  # dropping the reference frees the tensor
    else:
        from oxygen_torch.pool import VirtualPool

        pool = VirtualPool(backend="host", capacity=2 << 30)
        metrics.register_pool(pool)
        read, unit = metrics.pool_totals, 16 << 10
        alloc = lambda n: (pool.malloc(n), n)
        free = lambda h: pool.free(h[0], h[1])
    sampler = Sampler(path, read, interval).start()
    generate_pattern(alloc, free, unit)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    sampler.stop()


# ---------------------------------------------------------------------------------------------
# Command line


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m oxygen_torch plot", description=__doc__)
    p.add_argument("png", nargs="?", help="output PNG (same as -o)")
    p.add_argument("-o", "--output", help="output PNG (default oxygen_memory.png)")
    p.add_argument("--demo", action="store_true", help="record the built-in generate-like demo")
    p.add_argument(
        "--compare", action="store_true", help="also run on PyTorch's default CUDA allocator"
    )
    p.add_argument("--interval", type=float, default=0.005, help="seconds between samples")
    args = p.parse_args(argv)
    if args.demo == bool(cmd):
        p.error("give either --demo or a command after `--` (e.g. -- python my_script.py)")
    return args, cmd


def _unwritable(out: Path) -> str | None:
    """Why the PNG cannot be written, or None: found out before a run that may take minutes,
    by opening the file as savefig will (as root, permission bits say nothing)."""
    if out.is_dir():
        return "it is a directory"
    existed = out.exists()
    try:
        with open(out, "ab"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        out.unlink()
    return None


def _command(cmd: list[str]) -> list[str]:
    """`plot -- script.py args` runs the script with this Python, as `-- python script.py` would."""
    if cmd[0].endswith(".py") and Path(cmd[0]).is_file() and not os.access(cmd[0], os.X_OK):
        return [sys.executable, *cmd]
    return cmd


def _nothing_recorded(path: Path) -> bool:
    _, alloc, mapped = load(path)
    return max(alloc, default=0) == 0 and max(mapped, default=0) == 0


def _explain_empty(label: str) -> str:
    import torch

    why = (
        "this machine has no GPU, and CPU tensors do not go through the pool (oxygen_torch "
        "replaces PyTorch's CUDA allocator only). On a CPU, only pools the script makes itself "
        "(oxygen_torch.pool.VirtualPool, registered with oxygen_torch.tools.metrics.register_pool)"
        " and KV arenas are recorded; `plot --demo` shows one"
        if not torch.cuda.is_available()
        else "the script allocated no CUDA memory while it was recorded"
    )
    return f"plot: nothing went through oxygen_torch's pool in the {label} run: {why}. No chart."


def plot(argv: list[str] | None = None) -> int:
    args, cmd = _parse(list(sys.argv[2:] if argv is None else argv))
    out = Path(args.output or args.png or "oxygen_memory.png")
    reason = _unwritable(out)
    if reason:
        print(f"plot: cannot write the chart to {out}: {reason}", file=sys.stderr)
        return 2
    try:
        return _plot(args, _command(cmd) if cmd else cmd, out)
    except (FileNotFoundError, PermissionError) as exc:
        if exc.filename is None or str(exc.filename) != (cmd or [""])[0]:
            raise
        print(f"plot: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


def _plot(args: argparse.Namespace, cmd: list[str], out: Path) -> int:
    sources = ["oxygen"]
    if args.compare:
        import torch

        if torch.cuda.is_available():
            sources.append("torch")
        else:
            print("plot: --compare needs a GPU (PyTorch's default CUDA allocator); oxygen only")
    runs = []
    with tempfile.TemporaryDirectory(prefix="oxygen-plot-") as tmp:
        for source in sources:
            label = "oxygen_torch" if source == "oxygen" else "PyTorch default allocator"
            path = Path(tmp) / f"{source}.timeline"
            rc = _run_one(source, path, args, cmd, label)
            if rc != 0 or not path.exists() or not path.read_text().strip():
                print(f"plot: the {label} run failed (exit {rc}) or recorded nothing")
                return rc or 1
            if source == "oxygen" and _nothing_recorded(path):
                print(_explain_empty(label), file=sys.stderr)
                return 1
            runs.append((label, path))
        try:
            draw(runs, out)
        except OSError as exc:  # the file went away or the disk filled while the script ran
            print(f"plot: cannot write the chart to {out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    print(f"plot: wrote {out}")
    return 0


def _run_one(source: str, path: Path, args: argparse.Namespace, cmd: list[str], label: str):
    if cmd:
        return record(cmd, path, source, args.interval, label)
    code = (
        "from oxygen_torch.tools.cli_plot import demo_child; "
        f"demo_child({source!r}, {str(path)!r}, {args.interval!r})"
    )
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [pkg_parent, env.get("PYTHONPATH", "")] if p)
    return subprocess.run([sys.executable, "-c", code], env=env).returncode
