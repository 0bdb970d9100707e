"""Measuring the lab's paths: what the chapters time live and the benchmark CLIs write to benchmarks/.

    timing      wall, kernel and graphed time of a call; drafters at Laguna-XS.2's shapes
    context_kv  the three context-K/V paths against the GEMM floor, and the lab's targets
    decoding    tokens/s per method and block, one record format for both backends: the fast (static) path
                per batch and graphs setting, the eager teaching loop at batch 1; the static path's phases
    serving     a request stream at a concurrency on the fast path: continuous vs static batching, vllm bench
                serve's latencies, the phases per batch
    repetition  the repeated 4-gram share of a continuation; τ on repetitive vs non-repetitive continuations
    verification  vLLM's verification rules side by side: τ with intervals, fidelity to the target

``dflash_lab.tools`` holds the command lines around these (``python -m dflash_lab.tools.bench``)
and the markdown they write; a chapter imports from here, never from ``tools``.
"""
