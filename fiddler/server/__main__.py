"""python -m fiddler.server --model DIR [--gpu-budget-gb N] [--slots N] [--max-queue N] [--port P]

Serves the checkpoint in DIR over the OpenAI API on 127.0.0.1 (--host to change). SIGTERM (or Ctrl-C) stops
taking requests (503), finishes those in flight for up to --drain-timeout seconds, and exits 0; a second
Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see the README's "OpenMP" note


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fiddler.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: DIR's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--gpu-budget-gb", type=float, default=None,
                    help="GPU memory for the engine (default: 90%% of free CUDA memory; 0: no GPU; without CUDA a "
                         "budget > 0 is emulated on the CPU device)")
    ap.add_argument("--planner", choices=["makespan", "paper"], default="makespan")
    ap.add_argument("--placement", default="popularity",
                    help="popularity | random | none | all | fraction:X (fiddler.placement)")
    ap.add_argument("--popularity", default=None, help="an expert-popularity JSON for placement=popularity")
    ap.add_argument("--quant", choices=["q8_0", "q4_0"], default=None, help="experts and attention as llama.cpp blocks")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded at once (KV-cache rows)")
    ap.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 503s")
    ap.add_argument("--token-budget", type=int, default=512, help="tokens per engine step (chunked prefill)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV-cache positions per slot (default: min(context, 4096))")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a checkpoint directory is needed)")
    for name in ("slots", "max_queue", "token_budget"):
        if getattr(args, name) < (0 if name == "max_queue" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_queue' else 1}")
    if not 0 < args.port < 65536:
        ap.error("--port must be in 1..65535")
    return args


def loader(args):
    def load():
        import torch
        from transformers import AutoTokenizer

        from ..batch import BatchEngine
        from ..executors import FiddlerPolicy
        from ..gpu_side import GpuSide

        policy = FiddlerPolicy(placement=args.placement, popularity=args.popularity, planner=args.planner)
        be = BatchEngine.from_pretrained(args.model, slots=args.slots, token_budget=args.token_budget,
                                         max_queue=args.max_queue, dtype=getattr(torch, args.dtype),
                                         gpu=GpuSide.for_budget_gb(args.gpu_budget_gb), executor=policy,
                                         cpu_threads=args.cpu_threads, max_seq_len=args.max_seq_len,
                                         quant=args.quant)
        return be, AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    return load


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("the server needs its extra: pip install -e '.[server]' (fastapi, uvicorn)", file=sys.stderr)
        return 2
    from .app import ServerState, create_app, drain

    state = ServerState(loader(args), args.served_model_name or args.model.resolve().name)

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
                    print("fiddler.server: drain timeout; cancelling the requests still in flight", file=sys.stderr,
                          flush=True)
                if state.batch_engine is not None:
                    state.batch_engine.stop(drain=ok, timeout=10)
                self.should_exit = True
            threading.Thread(target=finish, name="fiddler-drain", daemon=True).start()

    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config)
    print(f"fiddler.server: serving {state.model_name} on http://{args.host}:{args.port}/v1 "
          "(loading; /health says when ready)", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
