"""Capturing a decode step as a CUDA graph, and replaying it.

A step of the shipped pair is hundreds of small kernels; launched one by one
from Python, the launches cost far more than the arithmetic (the target takes
~34 ms per eager forward on an H200 for 8.8 M parameters). A CUDA graph records
the kernels of one call once and replays them with one launch. That is only
correct when the call

    reads and writes the SAME tensors every time (static buffers: the KV caches,
        the decode state, the step's outputs), and
    never waits for the host or copies from it (no ``.item()``, no Python
        branches on tensor values, no ``torch.tensor(..., device="cuda")``):
        ``static_target`` / ``static_drafter`` / ``batched`` are written so.

``GraphedStep`` wraps such a call: on CUDA with ``enabled`` it warms the call up
on a side stream (cuBLAS handles, Triton compilation), captures it, and every
later ``step()`` is one ``graph.replay()``; otherwise ``step()`` just calls it
(the same kernels, launched eagerly: the "graphs off" timing, and the CPU path).
Steps of one decoder share one memory pool: they never run at the same time.
"""

from __future__ import annotations

import gc

import torch

# Replay a graph once when it is captured (then reset the state again): the first replay of a CUDA graph also
# uploads it to the device, a one-time cost of its own that would otherwise land in the first timed use of a
# step (a per-batch schedule's narrower step is first replayed in the middle of a served stream).
WARM_REPLAY = True


class GraphedStep:
    """``fn()`` replayed from a CUDA graph (or called directly when graphs are off).

    reset: run before each warm-up call, so that warm-up steps, which really
    execute and move the decode state, start from a valid state. The caller
    resets the state again before real decoding.
    """

    def __init__(self, fn, *, enabled: bool, device: torch.device, reset=None, pool=None, warmup: int = 2):
        self.fn = fn
        self.graph = None
        if not (enabled and device.type == "cuda"):
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if reset is not None:
                    reset()
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        if reset is not None:
            reset()
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: a collected object whose memory is pinned host
        # memory (an old decoder's staging buffer, say) frees it with CUDA calls that a capturing
        # stream forbids, and the capture fails ("operation not permitted when stream is capturing").
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                fn()
        finally:
            if collecting:
                gc.enable()
        if WARM_REPLAY:
            self.graph.replay()
            if reset is not None:
                reset()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def new_pool(device: torch.device):
    """A graph memory pool for the steps of one decoder (None off CUDA)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None
