"""Benchmarks, one subcommand each, results as JSON + a markdown table under benchmarks/.

    python -m dflash_lab.tools.bench context-kv [--quick]   # the three context-K/V paths vs the GEMM floor
    python -m dflash_lab.tools.bench spec-decode [--quick]  # tokens/s of the shipped pair on the fast path
    python -m dflash_lab.tools.bench serve [--quick]        # a request stream: continuous vs static batching
    python -m dflash_lab.tools.bench acceptance [--quick]   # acceptance of the shipped pair on the held-out prompts
    python -m dflash_lab.tools.bench drafters [--quick]     # both shipped drafters, two prompt sets, intervals
    python -m dflash_lab.tools.bench repetition [--quick]   # τ on repetitive vs non-repetitive continuations
    python -m dflash_lab.tools.bench tree [--speed] [--quick]  # DDTree against the chain, per node budget

Each benchmark is a module beside this one (bench_context_kv, bench_spec_decode,
bench_acceptance) that registers its subcommand; what they share (timing,
Laguna-XS.2 shapes, writing results) is in bench_common. Timings are taken in
one process, after warm-up, with CUDA events on a GPU (a host clock on a CPU),
and reported as medians. Nothing here imports plotly or vLLM: the benchmarks
run on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import sys

from . import (bench_acceptance, bench_context_kv, bench_drafters, bench_repetition, bench_serving, bench_spec_decode,
               bench_tree)

BENCHMARKS = (bench_context_kv, bench_spec_decode, bench_serving, bench_acceptance, bench_drafters, bench_repetition,
              bench_tree)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.tools.bench", description=__doc__.split("\n\n")[0])
    names = "context-kv,spec-decode,serve,acceptance,drafters,repetition,tree"
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + names + "}")
    for benchmark in BENCHMARKS:
        benchmark.add_command(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
