"""``make serve``: vLLM's OpenAI server with DFlash on the shipped pair (or $DFLASH_LAB_TARGET / $DFLASH_LAB_DRAFTER).

    python -m dflash_lab.vllm_engine [--num-speculative-tokens 15] [--port 8000] [--method ngram]

Prints the URL once the server answers, then serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from .process import VLLMEngineError
from .server import serve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-speculative-tokens", type=int, default=15)
    p.add_argument("--method", choices=["dflash", "ngram"], default="dflash")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--target", default=None, help="target checkpoint directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slower start)")
    p.add_argument("--no-shim", action="store_true", help="run without the lab's CPU shim (shows vLLM's CPU defects)")
    p.add_argument("--quiet", action="store_true", help="do not echo vLLM's log")
    args = p.parse_args(argv)
    try:
        with serve(num_speculative_tokens=args.num_speculative_tokens, method=args.method, port=args.port,
                   target=args.target, drafter=args.drafter, dtype=args.dtype, max_model_len=args.max_model_len,
                   enforce_eager=not args.compile, shim=not args.no_shim, timeout_s=900,
                   echo=None if args.quiet else sys.stderr) as server:
            print("\ncommand: " + " ".join(shlex.quote(a) for a in server.command), flush=True)
            print(f"\nvLLM serves {server.model_name} at {server.url} (OpenAI API: {server.url}/v1, "
                  f"counters: curl {server.url}/metrics). Ctrl-C stops it.", flush=True)
            while server.process.poll() is None:
                time.sleep(1)
            print(f"vLLM's server exited with code {server.process.poll()}", file=sys.stderr)
            return 1
    except (VLLMEngineError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
