"""``make serve``: vLLM's OpenAI server with DFlash on the shipped pair (or $DFLASH_LAB_TARGET / $DFLASH_LAB_DRAFTER).

    python -m dflash_lab.vllm_engine [--num-speculative-tokens 15] [--port 8000] [--method ngram]

Prints the port at once and the URL once the server answers, then serves until
stopped. Ctrl-C, SIGTERM and SIGHUP all stop vLLM's whole process tree (API
server, engine core, workers) before this process exits with 0: a stop asked for is not a failure,
so `make serve` ends without an error either.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from contextlib import contextmanager

from .kv_grouping import needs_hybrid_manager_disabled
from .process import VLLMEngineError, checkpoint_dirs
from .server import HOST, free_port, serve

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXAMPLE_PROMPT = "def fibonacci(n):"  # the README's example request


class Stopped(Exception):
    """A stop signal arrived; leaving ``serve`` stops vLLM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_stop_signal(signum, frame):
    # Ignore further stop signals: a second Ctrl-C must not cut vLLM's shutdown short
    # (stop() sends SIGTERM to vLLM's process group, then SIGKILL after a grace period).
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def quiet_lab_vllm():
    """The lab's vLLM 0.33 (a CUDA wheel), imported and run quietly in this process.

    The wrapper asks its KV-cache grouping whether to pass --disable-hybrid-kv-cache-manager;
    on a CPU that wheel logs what it lacks here (a CUDA runtime, Triton, its compiled ops),
    none of which concerns the server (vLLM's CPU build, in its own processes, logs as usual).
    """
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    loggers = [logging.getLogger(name) for name in ("torch", "vllm")]
    levels = [lg.level for lg in loggers]
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # read once, where vLLM sets up its own logging
    for lg in loggers:  # and where it does not (its notices then reach Python's last-resort handler)
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if saved is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = saved


def hybrid_manager_off(args) -> bool | None:
    """serve()'s disable_hybrid_kv_cache_manager for these checkpoints (None: no drafter, nothing to decide)."""
    if args.method != "dflash":
        return None
    target_dir, drafter_dir = checkpoint_dirs(args.target, args.drafter)
    with quiet_lab_vllm():
        return needs_hybrid_manager_disabled(target_dir, drafter_dir)


def example_request(url: str, model_name: str) -> str:
    """A curl command for one greedy completion of EXAMPLE_PROMPT on the running server."""
    body = {"model": model_name, "prompt": EXAMPLE_PROMPT, "max_tokens": 32, "temperature": 0}
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-speculative-tokens", type=int, default=15)
    p.add_argument("--method", choices=["dflash", "ngram"], default="dflash")
    p.add_argument("--port", type=int, default=None, help="default: a free port (printed at once)")
    p.add_argument("--target", default=None, help="target checkpoint directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slower start)")
    p.add_argument("--no-shim", action="store_true", help="run without the lab's CPU shim (shows vLLM's CPU defects)")
    p.add_argument("--quiet", action="store_true", help="do not echo vLLM's log")
    args = p.parse_args(argv)
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        port = args.port if args.port is not None else free_port()
        print(f"starting vLLM's server on http://{HOST}:{port} (about a minute on a small CPU)", flush=True)
        with serve(num_speculative_tokens=args.num_speculative_tokens, method=args.method, port=port,
                   target=args.target, drafter=args.drafter, dtype=args.dtype, max_model_len=args.max_model_len,
                   enforce_eager=not args.compile, shim=not args.no_shim, timeout_s=900,
                   progress=args.quiet,  # vLLM's echoed log shows the start; a bar would interleave with it
                   disable_hybrid_kv_cache_manager=hybrid_manager_off(args),
                   echo=None if args.quiet else sys.stderr) as server:
            print("\ncommand: " + " ".join(shlex.quote(a) for a in server.command), flush=True)
            print(f"\nvLLM serves {server.model_name} at {server.url} (OpenAI API: {server.url}/v1, "
                  f"counters: curl {server.url}/metrics). Ctrl-C stops it. Try:\n"
                  f"  {example_request(server.url, server.model_name)}", flush=True)
            while server.process.poll() is None:
                time.sleep(1)
            print(f"vLLM's server exited with code {server.process.poll()}", file=sys.stderr)
            return 1
    except (VLLMEngineError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as stop:  # serve() has stopped vLLM's process tree on the way out: a clean, asked-for stop
        print(f"\nstopped ({stop}): vLLM's processes have all exited", file=sys.stderr, flush=True)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
