"""python -m oxygen_torch serve PATH: load a local checkpoint, switch oxygen on, serve it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .loading import configure_oxygen, load, load_tokenizer, serve_overrides, warm_up

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
    a(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up before serving (oxygen_torch.warm_up: every rows bucket's "
        "decode graph captured; else the first steps of each batch size capture theirs)",
    )
    a(
        "--one-process",
        action="store_true",
        help="run the model in the server's own process (default: an engine process of its own, "
        "so HTTP and text work do not hold up the model's steps)",
    )
    return p  # fmt: skip


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
                warm_up(model, app.state.server.served.pad, args.max_model_len)
            engine_on, where = oxygen.scheduler.engine, "this process"
        else:
            serve_overrides(args.conf)  # (a bad configuration is told before anything loads)
            tokenizer = load_tokenizer(args.path)
            spec = EngineSpec(args.path, args.dtype, args.device, args.conf, not args.no_warmup,
                              None, args.max_queue, args.log_level, args.max_model_len)  # fmt: skip
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
