"""Programmatic dependent launch (PDL, Hopper and later): a decode step's next kernel starts while the last drains.

A decode step at one token is a chain of a few hundred small kernels, each reading a few to a few tens of MB.
Each launch ramps up (its programs are placed on the SMs) and drains (its last programs finish while the
others' SMs idle), and in a CUDA graph that ramp and drain, not the gap between launches, is what separates a
kernel from its bytes at full bandwidth. With PDL the next kernel is launched as soon as every program of the
current one has started (``gdc_launch_dependents``); its programs do what needs no earlier result (the one-row
kernel loads its first chunk of weights), then ``gdc_wait``: the previous kernel has finished and its writes
are visible. A kernel that waits before anything else still saves its launch.

Every kernel launched here with ``launch(x)`` must call ``enter`` (or ``release`` then ``wait``) in every
program, before it reads an earlier kernel's output or writes anything: that keeps the chain ordered (a kernel
completes only after its own wait, so waiting on the previous kernel is waiting on all before it). A kernel
launched without PDL (torch's, cuBLAS') simply starts after the previous one, as without this module.

    runs(x)       whether launches for x use PDL (CUDA, compute capability >= 9, Triton with grid dependency
                  control, ``ON``); never in Triton's CPU interpreter
    launch(x)     the launch keywords: {"PDL": on, "launch_pdl": True} where it runs, else {"PDL": False}
    enter(PDL)    in a kernel: release the next launch, then wait for the previous kernel
    counters(device, n, owner)  zeroed counters for a kernel whose last program to arrive finishes its work
"""

from __future__ import annotations

import torch

try:  # Triton is a GPU-side extra; grid dependency control came with Triton 3.3-3.4
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

# The switch: benchmarks time a step with it on and off in one process (both captured as their own graphs).
ON = True

_CAPABLE: dict = {}


def _launch_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - depends on the machine
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def runs(x: torch.Tensor) -> bool:
    """Whether kernels launched for x use PDL."""
    if not (ON and triton is not None and x.is_cuda):
        return False
    key = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if key not in _CAPABLE:
        _CAPABLE[key] = torch.cuda.get_device_capability(key)[0] >= 9 and _launch_option()
    return _CAPABLE[key]


_COUNTERS: dict = {}  # (device, owner) -> int32 zeros; _RETIRED keeps replaced ones alive for graphs that hold them
_RETIRED: list = []


def counters(device: torch.device, n: int, owner: str) -> torch.Tensor | None:
    """n zeroed int32 counters for ``owner``'s kernels (the attention's split merge, a GEMV's residual tail),
    kept per device: each program counts itself in on an atomic after its ``wait``, and the last to arrive
    finishes the launch's work and sets its counter back to 0. In a chain of launches on one stream no two
    kernels count at once (each counts after the previous has finished). None while a CUDA graph is being
    captured and none are allocated yet: an allocation there would belong to the graph's memory pool."""
    key = (torch.device(device), owner)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            _RETIRED.append(have)  # a captured graph may still count on it
        _COUNTERS[key] = have = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
    return have


def launch(x: torch.Tensor) -> dict:
    """Keywords for ``kernel[grid](...)``: the kernel's ``PDL`` constexpr, and Triton's launch option with it."""
    return {"PDL": True, "launch_pdl": True} if runs(x) else {"PDL": False}


if triton is not None:

    @triton.jit
    def release(PDL: tl.constexpr):
        """Let the next kernel launch (it waits in its own ``wait``); a no-op without PDL."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Block until the previous kernel has finished and its writes are visible; a no-op without PDL."""
        if PDL:
            gdc_wait()

    @triton.jit
    def enter(PDL: tl.constexpr):
        """``release`` then ``wait``: the first statement of a kernel whose every read depends on the last."""
        release(PDL)
        wait(PDL)
