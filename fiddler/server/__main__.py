"""python -m fiddler.server --model DIR [--gpu-budget-gb N|auto] [--slots N] [--max-queue N] [--port P]

Serves the checkpoint in DIR over the OpenAI API on 127.0.0.1 (--host to change; another address without an
API key is warned about). With an API key ($FIDDLER_API_KEY, or --api-key), every route but /health answers
401 unless the request carries `Authorization: Bearer <key>`. SIGTERM (or Ctrl-C) stops taking requests (503), finishes those in flight
for up to --drain-timeout seconds (those still running then end with finish_reason "abort"), and exits 0; a
second Ctrl-C exits at once. A model that fails to load exits 1 with the reason.

Requests must name this server in Host (an IP address, localhost, or --allowed-hosts), carry no foreign Origin
(--allowed-origins), POST application/json bodies of at most --max-body-bytes; connections must send their
headers within --header-timeout and their body within --body-timeout, and at most --max-connections are open.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import options as engine_options

API_KEY_ENV = "FIDDLER_API_KEY"


@dataclass(frozen=True)
class Size:
    """One of the server's sizes, written once: its flag, default and least value here; the harness's
    `serve.<key>` (runners/schema.py ServeConfig) takes the default from it and hands its value back through
    the flag (`size_flags`)."""
    key: str
    flag: str
    type: type
    default: Any
    minimum: float
    help: str

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


SIZES = (
    Size("slots", "--slots", int, 8, 1, "requests decoded at once (KV-cache rows)"),
    Size("max_queue", "--max-queue", int, 256, 0, "requests waiting for a slot before 503s"),
    Size("token_budget", "--token-budget", int, 512, 1, "tokens per engine step (chunked prefill)"),
    Size("drain_timeout_s", "--drain-timeout", float, 30.0, 0, "seconds to finish in-flight requests on SIGTERM"),
    Size("prefix_cache_mb", "--prefix-cache-mb", float, 0.0, 0,
         "MiB of prompts' KV entries kept for reuse: a prompt starting with a cached prefix computes only the rest "
         "(0: off)"),
)
SIZE = {s.key: s for s in SIZES}


def size_flags(serve) -> list[str]:
    """The flags giving the server `serve`'s sizes (an object with every Size's key), those at the server's
    default left out."""
    out: list[str] = []
    for s in SIZES:
        value = s.type(getattr(serve, s.key))
        if value != s.default:
            out += [s.flag, f"{value:g}" if s.type is float else str(value)]
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fiddler.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: DIR's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    engine_options.add_arguments(ap)  # the engine's options, one table with the harness's system=fiddler
    for s in SIZES:
        ap.add_argument(s.flag, type=s.type, default=s.default, help=f"{s.help} (default: {s.default:g})")
    ap.add_argument("--api-key", default=None,
                    help=f"a key every route but /health needs as 'Authorization: Bearer <key>' (else 401); "
                         f"prefer the environment variable {API_KEY_ENV}, which ps and shell history do not show")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV-cache positions per slot (default: min(context, 4096))")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g = ap.add_argument_group("what a client may send")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413 (default 4 MiB)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names served besides IP addresses and localhost ('*': any); others "
                        "get 403 (a DNS-rebinding page's requests carry its own name)")
    g.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed besides the server's own ('*': any); others get 403")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers before it is closed")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body has to arrive after its headers before the connection is closed")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--max-connections", type=int, default=512,
                   help="open connections at most; one more is closed at once")
    g.add_argument("--max-header-bytes", type=int, default=32 << 10,
                   help="a request's headers at most this large (else 400)")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a checkpoint directory is needed)")
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        ap.error("--api-key is empty")
    for s in SIZES:
        if not getattr(args, s.dest) >= s.minimum:
            ap.error(f"{s.flag} must be >= {s.minimum:g}")
    if not 0 < args.port < 65536:
        ap.error("--port must be in 1..65535")
    for name in ("max_body_bytes", "max_connections", "max_header_bytes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, api_key: bool = False) -> str | None:
    """What to tell whoever binds beyond this machine without an API key (anyone who reaches the port can use
    the model)."""
    if is_loopback(host) or api_key:
        return None
    return (f"fiddler.server: warning: --host {host} is not a loopback address: anyone who can reach this port can "
            f"use the server (it has no API key: set {API_KEY_ENV}); bind 127.0.0.1 unless that is meant")


def _names(csv: str) -> tuple[str, ...]:
    return tuple(n.strip().lower() for n in csv.split(",") if n.strip())


def loader(args):
    def load():
        import torch
        from transformers import AutoTokenizer

        from ..batch import BatchEngine
        from ..executors import FiddlerPolicy
        from ..gpu_side import GpuSide

        policy = FiddlerPolicy(placement=args.placement, popularity=args.popularity, planner=args.planner,
                               residency=args.residency)
        gpu = GpuSide.for_budget_gb(args.gpu_budget_gb)  # /health says what it chose, too
        chose = f"{gpu.budget_bytes} bytes, {gpu.describe()}" if gpu.has_gpu else "no GPU"
        print(f"fiddler.server: GPU budget: {gpu.chosen.source} -> {chose}", file=sys.stderr, flush=True)
        be = BatchEngine.from_pretrained(args.model, slots=args.slots, token_budget=args.token_budget,
                                         max_queue=args.max_queue, dtype=getattr(torch, args.dtype),
                                         gpu=gpu, executor=policy,
                                         cpu_threads=args.cpu_threads, max_seq_len=args.max_seq_len,
                                         quant=args.quant, prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)))
        return be, AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    return load


def main(argv=None) -> int:
    # before torch loads (here, not at import: the harness imports SIZES): docs/engine.md's "OpenMP" note
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("the server needs its extra: pip install -e '.[server]' (fastapi, uvicorn)", file=sys.stderr)
        return 2
    from .app import ServerState, create_app, drain
    from .guard import Limits
    from .transport import ConnectionLimits, uvicorn_kwargs

    warning = bind_warning(args.host, args.api_key is not None)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    limits = Limits(max_body_bytes=args.max_body_bytes, allowed_hosts=_names(args.allowed_hosts),
                    allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
                    api_key=args.api_key)
    state = ServerState(loader(args), args.served_model_name or args.model.resolve().name, limits=limits)

    class DrainingServer(uvicorn.Server):
        """uvicorn, but a first SIGTERM/SIGINT drains (503 for new requests) before it stops listening, and the
        process then exits 0 (uvicorn would re-raise the signal)."""

        draining = False

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

        def capture_signals(self):
            import contextlib

            @contextlib.contextmanager
            def handlers():
                old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGTERM, signal.SIGINT)}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)
            return handlers()

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                if sig == signal.SIGINT:
                    self.force_exit = self.should_exit = True
                return
            self.draining = True
            print(f"fiddler.server: {signal.Signals(sig).name}: draining (up to {args.drain_timeout:g} s)",
                  file=sys.stderr, flush=True)

            def finish():
                ok = drain(state, args.drain_timeout)
                if not ok:
                    print("fiddler.server: drain timeout; aborting the requests still in flight (finish_reason "
                          "'abort')", file=sys.stderr, flush=True)
                if state.batch_engine is not None:
                    state.batch_engine.stop(drain=ok, timeout=10)
                self.should_exit = True
            threading.Thread(target=finish, name="fiddler-drain", daemon=True).start()

    conn = ConnectionLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                            max_connections=args.max_connections, max_header_bytes=args.max_header_bytes,
                            keep_alive_s=args.keep_alive_timeout)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5, **uvicorn_kwargs(conn))
    server = DrainingServer(config)

    def load_failed(reason: str) -> None:  # nothing to serve: say why and exit non-zero (not 503s forever)
        print(f"fiddler.server: the model failed to load: {reason}", file=sys.stderr, flush=True)
        server.should_exit = True
    state.on_load_error = load_failed
    print(f"fiddler.server: serving {state.model_name} on http://{args.host}:{args.port}/v1 "
          "(loading; /health says when ready)", flush=True)
    server.run()
    return 1 if state.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
