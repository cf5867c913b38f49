"""python -m oxygen_torch serve PATH: load a local checkpoint, switch oxygen on, serve it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
EPILOG = """\
The oxygen configuration comes from OXYGEN_CONFIG_FILE (YAML), OXYGEN_CONF ("key:value,...")
and --conf (same form, highest precedence). The server turns scheduler.engine on, and wakes
streams at most every 10 ms (scheduler.stream_interval_ms: 10), unless one of them sets it.
The API key can also be given as OXYGEN_API_KEY (a flag shows in `ps`).

  python -m oxygen_torch serve ./Llama-3.2-1B-Instruct --port 8000 --max-queue 128
  curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m oxygen_torch serve",
        description="Serve a local checkpoint with an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) on the engine.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    a = p.add_argument
    a("path", help="a local checkpoint directory (model, tokenizer, chat template)")
    a("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    a("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    a("--dtype", choices=DTYPES, default="auto", help="weights' dtype (auto: the checkpoint's)")
    a("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    a("--model-name", default=None, help="the name clients give as `model` (default: PATH)")
    a(
        "--api-key",
        default=os.environ.get("OXYGEN_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 (default: $OXYGEN_API_KEY, else none)",
    )
    a(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for their first token before the server answers 429 (default 256)",
    )
    a(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens at most (default: the model's max_position_embeddings)",
    )
    a("--conf", default="", help='oxygen configuration, as OXYGEN_CONF: "key:value,key:value"')
    a("--max-body-bytes", type=int, default=8 << 20, help="largest request body (413 past it)")
    a("--body-timeout", type=float, default=30.0, help="seconds a body may take to arrive (408)")
    a(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    a("--max-connections", type=int, default=1024, help="open connections before 503")
    a("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    a("--no-warmup", action="store_true", help="skip the generate() call made before serving")
    a(
        "--one-process",
        action="store_true",
        help="run the model in the server's own process (default: an engine process of its own, "
        "so HTTP and text work do not hold up the model's steps)",
    )
    return p  # fmt: skip


# what the server sets unless the configuration does: the engine, and streams woken at most
# every 10 ms (a chunk holds the tokens of the steps since the last: hundreds of streams woken
# every step would take the interpreter lock from the engine's launches)
SERVE_DEFAULTS = {"scheduler.engine": True, "scheduler.stream_interval_ms": 10.0}


def serve_overrides(conf: str) -> dict:
    """enable()'s overrides: --conf, and SERVE_DEFAULTS where neither it nor OXYGEN_CONF nor
    the file sets the key."""
    import oxygen_torch
    from oxygen_torch.config import parse_conf_string

    overrides = parse_conf_string(conf) if conf else {}
    given = oxygen_torch.load_config(**overrides).sources
    for key, value in SERVE_DEFAULTS.items():
        if key not in given:
            overrides[key] = value
    return overrides


def configure_oxygen(conf: str):
    """enable() with --conf over OXYGEN_CONF / the file, and the server's defaults."""
    import oxygen_torch

    return oxygen_torch.enable(**serve_overrides(conf))


def load_tokenizer(path: str):
    """The tokenizer of a local checkpoint directory, nothing downloaded."""
    import transformers as T

    if not Path(path).is_dir():
        raise ValueError(f"{path}: not a directory (serve takes a local checkpoint directory)")
    return T.AutoTokenizer.from_pretrained(path, local_files_only=True)


def load(path: str, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) from a local directory, nothing downloaded; model on `device`."""
    import torch
    import transformers as T

    tokenizer = load_tokenizer(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = T.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    return model.to(device).eval(), tokenizer


def warm_up(model, pad: int) -> float:
    """Short greedy calls of one and of two rows: the KV pool is made (its size bounds
    requests) and first-call costs are paid before the first client (the engine's decode
    graphs compile at one row, then their sizes symbolic at a second rows bucket; later
    buckets only capture). Returns seconds."""
    import torch

    t0 = time.perf_counter()
    for rows in (1, 2):
        ids = torch.full((rows, 4), pad, device=model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                           do_sample=False)  # fmt: skip
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from .app import ServeConfig, Server, app_for, build_app
        from .engine_process import EngineFailed, EngineProcess, EngineSpec
        from .http import HttpConfig, bind, server
        from .served import Served
    except ImportError as err:
        print(f"serve needs FastAPI and uvicorn: pip install 'oxygen_torch[serve]' ({err})",
              file=sys.stderr)  # fmt: skip
        return 2
    engine = None
    try:
        http = HttpConfig(args.host, args.port, args.header_timeout, 5, args.max_connections,
                          args.log_level)  # fmt: skip
        cfg = ServeConfig(
            model_name=args.model_name or args.path, api_key=args.api_key or None,
            max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout, max_model_len=args.max_model_len,
        )  # fmt: skip
        t0 = time.perf_counter()
        if args.one_process:
            oxygen = configure_oxygen(args.conf)
            model, tokenizer = load(args.path, args.dtype, args.device)
            app = build_app(model, tokenizer, cfg)
            if not args.no_warmup:
                warm_up(model, app.state.server.served.pad)
            engine_on, where = oxygen.scheduler.engine, "this process"
        else:
            serve_overrides(args.conf)  # (a bad configuration is told before anything loads)
            tokenizer = load_tokenizer(args.path)
            spec = EngineSpec(args.path, args.dtype, args.device, args.conf, not args.no_warmup,
                              None, args.max_queue, args.log_level)  # fmt: skip
            engine = EngineProcess(spec)
            served = Served(engine.facts, tokenizer, cfg.max_model_len, engine.kv_tokens)
            app = app_for(Server(served, engine, cfg))
            engine_on, where = engine.engine_on, f"engine process {engine.process.pid}"
        print(f"loaded and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        sock = bind(args.host, args.port)
    except (ValueError, OSError, EngineFailed) as err:
        print(f"serve: {err}", file=sys.stderr)
        if engine is not None:
            engine.close()
        return 2
    host, port = sock.getsockname()[:2]
    device = app.state.server.served.facts.device
    print(f"serving {cfg.model_name!r} on http://{host}:{port}/v1 (device {device}, "
          f"{where}, engine {'on' if engine_on else 'off'}, max queue {cfg.max_queue})",
          flush=True)  # fmt: skip
    try:
        server(app, http).run(sockets=[sock])
    finally:
        if engine is not None:
            engine.close()
    return 0
