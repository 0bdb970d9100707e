"""Plumbing every other module shares: where things are, which device, seeds, safe writes.

This module sits at the bottom of the import graph: it imports torch and the
standard library, never the rest of the lab. One function per job:

    repository paths   REPO_ROOT, CHECKPOINTS_DIR, target_path(), drafter_path()
    device / dtype     resolve_device(), resolve_device_and_dtype(), device_name()
    seeding            seed_everything()  (returns a seeded CPU torch.Generator)
    tokenizer          load_tokenizer()
    safe writes        atomic_file(), atomic_directory(), write_json()
    timing             synchronized_time()
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

# ---------------------------------------------------------------------------
# Repository paths (the one way a module or a notebook finds the repository)
# ---------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
DEFAULT_TARGET = CHECKPOINTS_DIR / "laguna-tiny-code"
DEFAULT_DRAFTER = CHECKPOINTS_DIR / "laguna-tiny-code-dflash"
HELDOUT_PROMPTS = CHECKPOINTS_DIR / "heldout_prompts.json"
DOCSTRING_PROMPTS = CHECKPOINTS_DIR / "docstring_prompts.json"  # a second set: the continuation is a function body

TARGET_ENV, DRAFTER_ENV, DEVICE_ENV = "DFLASH_LAB_TARGET", "DFLASH_LAB_DRAFTER", "DFLASH_LAB_DEVICE"


def target_path() -> Path:
    """$DFLASH_LAB_TARGET, else the shipped target."""
    return Path(os.environ.get(TARGET_ENV) or DEFAULT_TARGET)


def drafter_path() -> Path:
    """$DFLASH_LAB_DRAFTER, else the shipped drafter."""
    return Path(os.environ.get(DRAFTER_ENV) or DEFAULT_DRAFTER)


# ---------------------------------------------------------------------------
# Device and dtype
# ---------------------------------------------------------------------------


def resolve_device(device=None, *, caller: str = "device") -> torch.device:
    """``device`` as a torch.device; None means $DFLASH_LAB_DEVICE, else cuda when present, else cpu.

    Names the argument (or the environment variable) when the device is not
    one torch knows or asks for CUDA where there is none.
    """
    if device is None or device == "":
        name = os.environ.get(DEVICE_ENV, "").strip()
        if not name:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device, source = name, f"{DEVICE_ENV}={name!r}"
    else:
        source = f"{caller}: `device` {device!r}"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{source} is not a torch device (try cpu, cuda, cuda:1): {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{source} asked for CUDA, but no CUDA device is available")
    return resolved


def resolve_dtype(dtype, *, caller: str = "dtype") -> torch.dtype | None:
    """A floating torch.dtype from a dtype or its name; None (or "auto") stays None."""
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{caller}: `dtype` must be a floating torch.dtype or its name, got {dtype!r}")
    return dtype


def resolve_device_and_dtype(device, dtype, caller: str):
    """(torch.device, floating torch.dtype or None), checked before any file is read."""
    return resolve_device(device, caller=caller), resolve_dtype(dtype, caller=caller)


def device_name(device: torch.device) -> str:
    """A human name for the hardware behind ``device`` (for benchmark records and logs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def is_int(x) -> bool:
    """An int, and not a bool (``True`` is an ``int`` to Python, never a count or a size to us)."""
    return isinstance(x, int) and not isinstance(x, bool)


def first_parameter(module):
    """The module's first parameter (its device and dtype), or None for an object without parameters."""
    try:
        return next(module.parameters())
    except (StopIteration, AttributeError):
        return None


def upload(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` from host memory without the host waiting for the device's queue: a copy from pageable
    memory into CUDA memory synchronises the stream first, so the host would idle until every step launched
    before it had run. On CUDA the copy goes through a fresh pinned buffer (torch's caching host allocator keeps
    it until the copy has run) and is queued behind that work; elsewhere it is a plain copy."""
    if dst.is_cuda and not src.is_cuda:
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)


def synchronized_time(device: torch.device) -> float:
    """perf_counter() after the device has finished its queued work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------------------
# Seeding
# ---------------------------------------------------------------------------


def seed_everything(seed: int = 0, *, deterministic: bool = True) -> torch.Generator:
    """Seed python, numpy and torch (every device); return a CPU generator seeded the same.

    ``deterministic`` asks torch for deterministic kernels where it has them and
    only warns where it has none, so a notebook never fails on a GPU op that
    lacks one.
    """
    import numpy as np

    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS determinism; read at CUDA init
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# Tokenizer (the one way to tokenize: the target directory's tokenizer.json)
# ---------------------------------------------------------------------------


def load_tokenizer(path=None):
    """The tokenizer of a target directory (default: target_path()), as a transformers fast tokenizer, offline."""
    from transformers import AutoTokenizer  # heavy; only the callers that tokenize pay for it

    path = Path(path) if path is not None else target_path()
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path} (train one with `python -m dflash_lab.train tokenizer`)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ---------------------------------------------------------------------------
# Safe writes: a failure leaves the old file or directory, never half a new one
# ---------------------------------------------------------------------------


def atomic_directory(out_dir, write) -> Path:
    """Run ``write(tmp_dir)`` then move tmp_dir to ``out_dir`` (replacing it).

    The previous ``out_dir`` is only removed after the new one is complete; on
    any failure the temporary directory is deleted and ``out_dir`` is untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = None
    try:
        write(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)  # put the previous directory back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def atomic_file(path, write) -> Path:
    """Run ``write(tmp_path)`` then rename tmp_path over ``path``.

    On any failure the temporary file is removed and ``path`` keeps its old
    content (or stays absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path, obj, *, indent: int = 2) -> Path:
    """``obj`` as JSON at ``path``, atomically."""
    text = json.dumps(obj, indent=indent) + "\n"
    return atomic_file(path, lambda tmp: Path(tmp).write_text(text))
