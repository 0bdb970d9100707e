"""The shipped pair: a tiny Laguna code model and its DFlash drafter.

    target, drafter, tokenizer = load_default_pair()

loads ``checkpoints/laguna-tiny-code/`` (transformers LagunaForCausalLM +
tokenizer) and ``checkpoints/laguna-tiny-code-dflash/`` (the drafter, in vLLM's
DFlashLagunaForCausalLM layout). Both were trained by ``python -m
dflash_lab.train`` (see its training_log.json files). Environment variables
point the lab at other checkpoints, e.g. the real Laguna XS.2 pair on a GPU box:

    DFLASH_LAB_TARGET   target directory (config.json, *.safetensors, tokenizer)
    DFLASH_LAB_DRAFTER  drafter directory (config.json, model.safetensors)
    DFLASH_LAB_DEVICE   cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)

Two drafters are trained for the shipped target, on the same data and budget:
``drafter="paper"`` (the default: full attention, non-causal inside the block, as in
the DFlash paper) and ``drafter="poolside"`` (sliding window 64, causal inside the
block, as Poolside ships Laguna-S-2.1-DFlash), in ``checkpoints/laguna-tiny-code-dflash-poolside/``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from .pair_files import check_pair_files, weight_files
from .runtime import (
    CHECKPOINTS_DIR, DEFAULT_DRAFTER, DEFAULT_TARGET, DEVICE_ENV, DOCSTRING_PROMPTS, DRAFTER_ENV, HELDOUT_PROMPTS,
    TARGET_ENV,
    drafter_path, load_tokenizer, resolve_device, resolve_device_and_dtype, target_path,
)


# The shipped drafters by name: the default one (the paper's recipe; $DFLASH_LAB_DRAFTER replaces it),
# and Poolside's sliding-window, causal one (trained for the shipped target only).
DRAFTERS = {"paper": DEFAULT_DRAFTER, "poolside": CHECKPOINTS_DIR / "laguna-tiny-code-dflash-poolside"}
DRAFTER2_ENV = "DFLASH_LAB_DRAFTER2"  # a second drafter for the target in use (chapters that compare two)
# A third prompt set: held-out prompts whose continuation the shipped target does not loop on (tools.bench_repetition).
NONREPETITIVE_PROMPTS = CHECKPOINTS_DIR / "nonrepetitive_prompts.json"


def is_shipped_target() -> bool:
    """True when the target in use ($DFLASH_LAB_TARGET, else the shipped one) is the shipped target."""
    return target_path().resolve() == DEFAULT_TARGET.resolve()


def is_shipped_pair() -> bool:
    """True when both the target and the drafter in use are the shipped ones (committed records belong to it)."""
    return is_shipped_target() and drafter_path().resolve() == DEFAULT_DRAFTER.resolve()


def pair_drafters() -> dict[str, Path]:
    """The drafters that belong to the target in use, by role: ``"paper"`` is $DFLASH_LAB_DRAFTER (else the shipped
    default); ``"poolside"`` is $DFLASH_LAB_DRAFTER2, else the shipped Poolside-style drafter when the target is the
    shipped one, else absent (a drafter trained for another target would not fit this one)."""
    out = {"paper": drafter_path()}
    second = os.environ.get(DRAFTER2_ENV)
    if second:
        out["poolside"] = Path(second)
    elif is_shipped_target():
        out["poolside"] = DRAFTERS["poolside"]
    return out


def second_drafter_missing() -> str | None:
    """None when the target in use has a second drafter; else the sentence a chapter prints when it skips a
    comparison of two drafters."""
    if "poolside" in pair_drafters():
        return None
    return (f"the target in use ({target_path()}) is not the shipped one and ${DRAFTER2_ENV} is not set, so there "
            f"is no second drafter to compare with (the shipped Poolside-style drafter was trained for the shipped "
            f"target only); set ${DRAFTER2_ENV} to a second drafter for this target to run the comparison")


def default_device() -> torch.device:
    """$DFLASH_LAB_DEVICE if set, else cuda when available, else cpu."""
    return resolve_device(None)


def load_default_pair(device=None, *, dtype: torch.dtype | None = None, drafter: str = "paper"):
    """(target, drafter, tokenizer), ready for inference on ``device``.

    device: None means default_device(). dtype: None means float32 on the CPU
    (bf16 weights, float32 arithmetic: exact greedy decoding on any laptop) and
    the checkpoints' own dtype on an accelerator. drafter: "paper" (the default
    drafter: full attention, non-causal; $DFLASH_LAB_DRAFTER replaces it) or
    "poolside" (sliding window 64, causal), see DRAFTERS.
    """
    if drafter not in DRAFTERS:
        raise ValueError(f"load_default_pair: `drafter` must be one of {sorted(DRAFTERS)}, got {drafter!r}")
    if drafter not in pair_drafters():
        raise FileNotFoundError(f"load_default_pair(drafter={drafter!r}): {second_drafter_missing()}")
    from .checkpoint import load_drafter
    from .target import load_target

    device, dtype = resolve_device_and_dtype(device if device is not None else default_device(), dtype,
                                             "load_default_pair")
    tpath, dpath = target_path(), pair_drafters()[drafter]
    for what, path, env in (("target", tpath, TARGET_ENV),
                            ("drafter", dpath, DRAFTER_ENV if drafter == "paper" else DRAFTER2_ENV)):
        if not path.is_dir():
            raise FileNotFoundError(f"{what} checkpoint directory {path} does not exist "
                                    f"(set ${env} to point elsewhere)")
    if dtype is None and device.type == "cpu":
        dtype = torch.float32
    check_pair_files(tpath, dpath)  # a missing shard or a misfit drafter is named before anything loads
    target = load_target(tpath, device=device, dtype=dtype)
    drafter = load_drafter(dpath, device=device, dtype=dtype or next(target.parameters()).dtype)
    drafter.config.validate_against_target(target.config)
    for p in list(target.parameters()) + list(drafter.parameters()):
        p.requires_grad_(False)
    return target.eval(), drafter.eval(), load_tokenizer(tpath)


def load_pair(device=None, *, dtype: torch.dtype | None = None):
    """(target, {role: drafter} for every drafter of the pair in use (see ``pair_drafters``), tokenizer)."""
    target, drafter, tokenizer = load_default_pair(device, dtype=dtype)
    drafters = {"paper": drafter}
    for role in pair_drafters().keys() - {"paper"}:
        drafters[role] = load_default_pair(device, dtype=dtype, drafter=role)[1]
    return target, drafters, tokenizer


def heldout_prompts(path=None) -> list[dict]:
    """The held-out prompt set: dicts with ``id``, ``source`` (stdlib path), ``first_line``, ``text``."""
    from .corpus import load_prompts

    return load_prompts(path or HELDOUT_PROMPTS)


def docstring_prompts(path=None) -> list[dict]:
    """The docstring-first prompt set (``corpus.cut_docstring_prompts``, checkpoints/docstring_prompts.json): a
    function's signature and docstring, the continuation its body; dicts as ``heldout_prompts``'s, plus ``def_line``."""
    return heldout_prompts(path or DOCSTRING_PROMPTS)


def nonrepetitive_prompts(path=None) -> list[dict]:
    """The non-repetitive prompt set (checkpoints/nonrepetitive_prompts.json): held-out prompts whose greedy
    continuation by the shipped target repeats fewer than a quarter of its 4-grams; dicts as ``heldout_prompts``'s,
    plus ``repeated_4gram_share``."""
    return heldout_prompts(path or NONREPETITIVE_PROMPTS)


def pair_fingerprint() -> dict:
    """Which pair a record was measured on: the first 12 hex digits of the SHA-256 over each checkpoint's weight
    files (every shard, in name order), and each drafter's depth. Benchmarks store it; chapters compare it with the
    pair in use, so a record of the shipped pair is never shown as a user's."""
    import json

    def digest(directory) -> str:  # read once per file state: a chapter asks several times, a real target is GBs
        files = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in weight_files(directory))
        return _weights_digest(files)

    out = {"target": digest(target_path())}
    for name, directory in pair_drafters().items():
        layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
        out[name] = {"weights": digest(directory), "num_hidden_layers": layers}
    return out


@functools.lru_cache(maxsize=32)
def _weights_digest(files: tuple) -> str:
    """The first 12 hex digits of the SHA-256 over the files' bytes, in order ((path, size, mtime) keys the cache)."""
    h = hashlib.sha256()
    for path, _size, _mtime in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def measured_on_this_pair(record: dict) -> bool:
    """True when ``record["pair"]`` (a benchmark's ``pair_fingerprint()``) is the pair in use."""
    return record.get("pair") == pair_fingerprint()


def record_note(record: dict) -> str | None:
    """None when a committed benchmark ``record`` was measured on the pair in use; else the phrase a chapter
    prints beside its numbers, naming whose they are (never presented as the user's)."""
    if measured_on_this_pair(record):
        return None
    depth = ((record.get("pair") or {}).get("paper") or {}).get("num_hidden_layers", "?")
    if is_shipped_pair():
        return f"a committed run on an earlier shipped pair ({depth}-layer drafter), not these checkpoints"
    return (f"the shipped pair's committed run, not your pair ({target_path().name}): re-run the benchmark on your "
            "pair to measure it")

