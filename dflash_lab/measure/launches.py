"""How many kernels a forward launches, counted on any device (Triton's CPU interpreter included).

In a CUDA graph a decode step of a small model costs its number of kernels more than its bytes: each
launch costs a few microseconds however little it reads. The count itself does not need a GPU: every
kernel is either an ATen op that computes (views, allocations and metadata launch nothing) or a Triton
kernel, and both pass through Python. ``count_launches`` records them:

    with count_launches() as c:
        static_target.forward(ids, positions)
    c.total, c.by_name        # kernels, and each op's or Triton kernel's share
    c.syncs                   # host reads of a device value (``.item()``, ``.tolist()``): none may sit
                              # inside a graphed step

A count is a proxy for the GPU's: one ATen op is one CUDA kernel for the ops the static path uses, bar
cuBLAS's split-K GEMMs (a second, reducing kernel) and ops whose CUDA and CPU decompositions differ.
Under ``TRITON_INTERPRET=1`` the Triton kernels run on the CPU and are counted as they would launch.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that allocate or describe memory without a kernel
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "alias", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
         "_reshape_alias", "set_", "resize_"}
_SYNCS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero"}


class _Recorder(TorchDispatchMode):
    def __init__(self, seen: "Launches", host_free: bool, where: bool):
        super().__init__()
        self.seen, self.paused, self.host_free, self.where = seen, 0, host_free, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in _SYNCS:
            self.seen.syncs[name] += 1
        elif not func.is_view and name not in _FREE and not (self.host_free and _on_host(args, kwargs, out)):
            self.seen.counts[name] += 1
            if self.where:
                self.seen.sites[(_site(), f"aten.{name}")] += 1
        return out


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _site() -> str:
    """The innermost frame of the lab's or transformers' code that called the op: file:line."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if ("dflash_lab" in frame.filename and "measure/launches" not in frame.filename) \
                or "transformers" in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _on_host(args, kwargs, out) -> bool:
    return all(t.device.type == "cpu" for t in _tensors((args, kwargs, out)))


class Launches:
    """What ``count_launches`` saw."""

    def __init__(self):
        self.counts, self.syncs, self.triton = Counter(), Counter(), Counter()
        self.sites = Counter()  # (file:line, kernel) -> launches, with count_launches(where=True)

    @property
    def total(self) -> int:
        return sum(self.counts.values()) + sum(self.triton.values())

    @property
    def by_name(self) -> Counter:
        return Counter({**{f"aten.{k}": v for k, v in self.counts.items()},
                        **{f"triton.{k}": v for k, v in self.triton.items()}})

    def __repr__(self) -> str:
        return f"Launches(total={self.total}, syncs={sum(self.syncs.values())}, top={self.by_name.most_common(6)})"


@contextmanager
def count_launches(host_free: bool = False, where: bool = False):
    """Count the kernels launched inside the block (see the module docstring). host_free: ops whose tensors are
    all on the CPU launch nothing (a GPU run building a small index on the host); off on a CPU-only run.
    where: also count by call site (``Launches.sites``), slower."""
    seen = Launches()
    recorder = _Recorder(seen, host_free, where)
    restore = []
    try:  # a Triton launch is one kernel; what Triton does to launch it (its interpreter's copies) is not
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit

        def wrap(cls):
            run = cls.run

            def counted(self, *args, **kwargs):
                if kwargs.get("warmup"):
                    return run(self, *args, **kwargs)
                name = getattr(self, "__name__", None) or self.fn.__name__
                seen.triton[name] += 1
                if where:
                    seen.sites[(_site(), f"triton.{name}")] += 1
                recorder.paused += 1
                try:
                    return run(self, *args, **kwargs)
                finally:
                    recorder.paused -= 1
            cls.run = counted
            restore.append((cls, run))

        wrap(interp.InterpretedFunction)
        wrap(jit.JITFunction)
    except ImportError:  # pragma: no cover - Triton is a GPU-side extra
        pass
    try:
        with recorder:
            yield seen
    finally:
        for cls, run in restore:
            cls.run = run


def phase_launches(decoder, prompts, *, max_new_tokens: int, host_free: bool | None = None) -> dict:
    """The kernels each phase of one decode step launches (``Launches`` per phase name), on ``decoder``.

    Prefills ``prompts``, runs one step uncounted (its one-off work: the first step's block ids, Triton's
    specialisations), then counts each phase of the next step, run eagerly in order. host_free defaults to
    True on a GPU (a small index built on the host launches nothing there) and False on the CPU.
    """
    from ..spec_decode.fast.decoder import PHASES

    if host_free is None:
        host_free = decoder.device.type != "cpu"
    decoder.prefill([p.to(decoder.device) for p in prompts], max_new_tokens, ())
    decoder._step()
    counted = {}
    for name in PHASES:
        with count_launches(host_free=host_free) as seen:
            getattr(decoder, f"_{name}")()
        counted[name] = seen
    return counted
