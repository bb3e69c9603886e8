"""`ember serve`: the OpenAI-compatible HTTP server (app/serve). Starlette and uvicorn are
imported only here, when the command runs."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ember.models.support.errors import EmberError

from .common import load_engine, model_path


def run(args) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise EmberError(f"`ember serve` needs Starlette and uvicorn ({exc}); install them "
                         "with: pip install starlette uvicorn") from None
    api_key = args.api_key
    if api_key is None:
        api_key = os.environ.get("EMBER_API_KEY") or None
    _check(args, api_key)
    sock = _listen(args.host, args.port)  # before loading: a taken port fails at once
    try:
        _serve(args, sock, api_key)
    finally:
        sock.close()
    return 0


def _serve(args, sock: socket.socket, api_key: str | None) -> None:
    import uvicorn

    from ember.app.serve.server import create_app
    from ember.app.serve.worker import EngineWorker

    engine = load_engine(args)
    path = Path(model_path(args))
    model_id = args.model_name or path.name
    worker = EngineWorker(engine, max_queue=args.max_queue)
    app = create_app(worker, model_id, api_key=api_key,
                     created=int(path.stat().st_mtime), max_tokens=args.max_tokens)
    host, port = sock.getsockname()[:2]
    if args.host in ("0.0.0.0", "::", ""):
        print(f"ember: warning: listening on every network interface ({args.host}): anyone "
              "who can reach this machine can use the model"
              + ("" if api_key else "; consider --api-key"), file=sys.stderr)
    print(f"ember: serving {model_id!r} at http://{_url_host(host)}:{port}/v1 (context "
          f"{engine.n_ctx} tokens, up to {args.max_queue} requests queued)", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        worker.close()
        engine.close()


def _check(args, api_key: str | None) -> None:
    if not 0 <= args.port <= 65535:
        raise EmberError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise EmberError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise EmberError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if api_key is not None and not api_key.strip():
        raise EmberError("--api-key must not be empty")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EmberError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
