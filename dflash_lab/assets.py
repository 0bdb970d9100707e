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

import torch

from .runtime import (
    CHECKPOINTS_DIR, DEFAULT_DRAFTER, DEFAULT_TARGET, DEVICE_ENV, DOCSTRING_PROMPTS, DRAFTER_ENV, HELDOUT_PROMPTS, TARGET_ENV,
    drafter_path, load_tokenizer, resolve_device, resolve_device_and_dtype, target_path,
)


# The shipped drafters by name: the default one (the paper's recipe; $DFLASH_LAB_DRAFTER replaces it),
# and Poolside's sliding-window, causal one.
DRAFTERS = {"paper": DEFAULT_DRAFTER, "poolside": CHECKPOINTS_DIR / "laguna-tiny-code-dflash-poolside"}


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
    from .checkpoint import load_drafter
    from .target import load_target

    device, dtype = resolve_device_and_dtype(device if device is not None else default_device(), dtype, "load_default_pair")
    tpath, dpath = target_path(), drafter_path() if drafter == "paper" else DRAFTERS[drafter]
    if drafter != "paper" and not dpath.is_dir():
        raise FileNotFoundError(f"the {drafter!r} drafter checkpoint directory {dpath} does not exist")
    for what, path, env in (("target", tpath, TARGET_ENV), ("drafter", dpath, DRAFTER_ENV)):
        if not path.is_dir():
            raise FileNotFoundError(f"{what} checkpoint directory {path} does not exist (set ${env} to point elsewhere)")
    if dtype is None and device.type == "cpu":
        dtype = torch.float32
    target = load_target(tpath, device=device, dtype=dtype)
    drafter = load_drafter(dpath, device=device, dtype=dtype or next(target.parameters()).dtype)
    drafter.config.validate_against_target(target.config)
    for p in list(target.parameters()) + list(drafter.parameters()):
        p.requires_grad_(False)
    return target.eval(), drafter.eval(), load_tokenizer(tpath)


def heldout_prompts(path=None) -> list[dict]:
    """The held-out prompt set: dicts with ``id``, ``source`` (stdlib path), ``first_line``, ``text``."""
    from .corpus import load_prompts

    return load_prompts(path or HELDOUT_PROMPTS)


def docstring_prompts(path=None) -> list[dict]:
    """The docstring-first prompt set (``corpus.cut_docstring_prompts``, checkpoints/docstring_prompts.json): a
    function's signature and docstring, the continuation its body; dicts as ``heldout_prompts``'s, plus ``def_line``."""
    return heldout_prompts(path or DOCSTRING_PROMPTS)


def pair_fingerprint() -> dict:
    """Which shipped pair a record was measured on: the first 12 hex digits of each checkpoint's weights'
    SHA-256, and each drafter's depth. Benchmarks store it; chapters compare it with the checkpoints here."""
    import hashlib
    import json

    def digest(directory) -> str:
        h = hashlib.sha256()
        with open(directory / "model.safetensors", "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()[:12]

    out = {"target": digest(target_path())}
    for name, directory in DRAFTERS.items():
        layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
        out[name] = {"weights": digest(directory), "num_hidden_layers": layers}
    return out


def measured_on_this_pair(record: dict) -> bool:
    """True when ``record["pair"]`` (a benchmark's ``pair_fingerprint()``) is the pair in checkpoints/."""
    return record.get("pair") == pair_fingerprint()

