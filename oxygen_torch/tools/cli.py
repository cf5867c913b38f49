"""python -m oxygen_torch doctor | stats | plot | serve

doctor: is this install usable here, and what will oxygen_torch do on this machine?
stats, plot: see cli_stats.py and cli_plot.py; serve: serve/command.py.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

from ..config import OxygenConfig, load_config
from ..pool import native as _native


def _version_of(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception as exc:  # a broken install is what doctor is for: report, don't crash
        return f"not usable ({type(exc).__name__}: {exc})"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def choose_backend(cfg: OxygenConfig, cuda_ok: bool) -> str:
    if cfg.pool.backend != "auto":
        return cfg.pool.backend
    return "cuda" if cuda_ok else "host"


def _probe_cuda(out: list[str]) -> bool:
    """Appends what the driver says; returns whether the cuda backend works on device 0."""
    try:
        drv, count = _native.cuda_probe()
    except _native.NativeError as exc:
        out.append(f"CUDA driver    : none ({exc})")
        return False
    out.append(f"CUDA driver    : {drv // 1000}.{drv % 1000 // 10}, {count} device(s)")
    ok = False
    for dev in range(count):
        try:
            info = _native.cuda_device_info(dev)
        except _native.NativeError as exc:
            out.append(f"  device {dev}     : unusable ({exc})")
            continue
        out.append(
            f"  device {dev}     : {info['name']}, VMM {'yes' if info['vmm_supported'] else 'NO'}, "
            f"granularity {info['granularity'] // 1024} KiB, "
            f"free {_gib(info['free_bytes'])} of {_gib(info['total_bytes'])}"
        )
    if count:
        try:
            _native.backend_selftest("cuda", 0)
            out.append("cuda backend   : reserve/create/map/access/unmap/release OK on device 0")
            ok = True
        except _native.NativeError as exc:
            out.append(f"cuda backend   : FAILED ({exc})")
    return ok


def _leak_section(out: list[str], cuda_ok: bool, detail: bool) -> list[str]:
    """Runs the leak check (leakcheck.py); appends its summary to ``out``, returns the leaks."""
    from . import leakcheck

    rep = leakcheck.run(("host", "cuda") if cuda_ok else ("host",))
    if detail:
        out.extend(f"  checked: {line}" for line in rep.checked)
        out.extend(f"  skipped: {line}" for line in rep.skipped)
    verdict = "every physical handle and reserved range released" if rep.ok else "LEAKS FOUND"
    if rep.ok and rep.skipped:
        verdict = "no leak seen; not checked: " + "; ".join(rep.skipped)
    out.append(f"leak check     : {verdict}" + ("" if detail else " (--leak-check: details)"))
    return rep.leaks


def doctor(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_torch doctor")
    parser.add_argument("--leak-check", action="store_true", help="print the leak check's details")
    args = parser.parse_args(argv or [])
    out: list[str] = []
    problems: list[str] = []
    out.append(f"python         : {platform.python_version()} ({sys.executable})")
    for mod in ("torch", "triton", "transformers"):
        out.append(f"{mod:<15}: {_version_of(mod)}")
    try:
        out.append(f"native library : {_native.LIB_PATH} (version {_native.version()})")
        gran = _native.backend_selftest("host")
        out.append(
            f"host backend   : reserve/create/map/access/unmap/release OK, page {gran >> 20} MiB"
        )
    except (_native.NativeLibraryError, _native.NativeError) as exc:
        problems.append(str(exc))
        out.append(f"native library : FAILED ({exc})")
    cuda_ok = _probe_cuda(out) if not problems else False
    try:
        import torch

        out.append(
            f"torch CUDA     : {'available' if torch.cuda.is_available() else 'not available'}"
            f" (torch build CUDA {torch.version.cuda or 'none'})"
        )
    except Exception as exc:
        problems.append(f"torch is not importable: {exc}")
    try:
        cfg = load_config()
    except ValueError as exc:
        problems.append(f"configuration: {exc}")
        cfg = None
    if cfg is not None:
        backend = choose_backend(cfg, cuda_ok)
        if backend == "cuda" and not cuda_ok:
            problems.append("pool.backend is 'cuda' but the cuda backend does not work here")
        out.append(
            f"pool backend   : {backend}" + ("" if cfg.pool.backend != "auto" else " (auto)")
        )
        if backend == "host":
            out.append(
                "mode           : CPU paths — host-memory pool, attention through the "
                "float64 reference / Triton interpreter; no GPU is used"
            )
        out.append("configuration  :")
        for key, value in cfg.as_dict().items():
            shown = value.name.lower() if hasattr(value, "name") else str(value)
            src = cfg.sources.get(key)
            out.append(f"  {key:<28} {shown}" + (f"  (from {src})" if src else ""))
    leaks = _leak_section(out, cuda_ok, args.leak_check) if not problems else []
    for line in out:
        print(line)
    if problems:
        print("NOT USABLE:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("usable: yes")
    if leaks:
        print("LEAKED:")
        for leak in leaks:
            print(f"  - {leak}")
        return 1
    return 0


def _stats(argv: list[str]) -> int:
    from .cli_stats import stats

    return stats(argv)


def _plot(argv: list[str]) -> int:
    from .cli_plot import plot

    return plot(argv)


def _serve(argv: list[str]) -> int:
    from .serve.command import main as serve

    return serve(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # stats, plot and serve parse their own arguments (plot passes everything after `--` to a
    # script).
    own = {"stats": _stats, "plot": _plot, "serve": _serve}
    if argv and argv[0] in own:
        return own[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="python -m oxygen_torch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the install and print what oxygen_torch will do here")
    sub.add_parser("stats", help="print memory_stats() of this or a running process (--url)")
    sub.add_parser("plot", help="draw allocated vs mapped bytes over time of a script or --demo")
    sub.add_parser("serve", help="serve a local checkpoint with an OpenAI-compatible HTTP API")
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        return doctor(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
