"""Drafter checkpoints in vLLM 0.33's ``DFlashLagunaForCausalLM`` layout.

A checkpoint is a directory with ``config.json`` and ``model.safetensors``.
Tensor names carry no ``model.`` prefix (vLLM adds it on load) and there is no
``embed_tokens`` / ``lm_head``: both are the target's.

    layers.{j}.input_layernorm.weight            layers.{j}.post_attention_layernorm.weight
    layers.{j}.self_attn.qkv_proj.weight          layers.{j}.self_attn.o_proj.weight
    layers.{j}.self_attn.g_proj.weight            layers.{j}.self_attn.{q,k}_norm.weight
    layers.{j}.mlp.{gate,up,down}_proj.weight
    aux_hidden_norms.{i}.weight   fc.weight   hidden_norm.weight   norm.weight

Loading proves alignment nanoGPT-style: every expected name present, no
unexpected name, every shape equal, every value finite, before anything is
copied. Saving writes into a temporary sibling directory and renames it into
place, so a failure never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import DFlashDrafterConfig, read_json
from .drafter import DFlashLagunaDrafter
from .runtime import atomic_directory, resolve_device_and_dtype

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or does not match the config."""


def save_drafter(drafter: DFlashLagunaDrafter, out_dir, *, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors in vLLM's layout, atomically."""
    if not isinstance(drafter, DFlashLagunaDrafter):
        raise TypeError(f"save_drafter expects a DFlashLagunaDrafter, got {type(drafter).__name__}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / CONFIG_NAME).is_file() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # Saving replaces out_dir as a whole: never do that to something that is not a checkpoint.
        raise FileExistsError(f"save_drafter: `out_dir` {out_dir} exists and is not a checkpoint directory; "
                              "refusing to replace it")
    tensors = {name: t.detach().to("cpu", dtype or t.dtype).contiguous() for name, t in drafter.state_dict().items()}
    config = drafter.config.to_dict()  # target_layer_count as configured: a guess would outlive its target
    config["torch_dtype"] = str(dtype or next(drafter.parameters()).dtype).removeprefix("torch.")

    def write(tmp: Path):
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    atomic_directory(out_dir, write)


def _read_config(path: Path, weights: Path | None) -> DFlashDrafterConfig:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in drafter checkpoint {path}")
    raw = read_json(file)
    if isinstance(raw, dict) and raw.get("target_hidden_size") is None and weights is not None:
        # Real vLLM checkpoints need not state the target's hidden size: read it off fc.
        ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
        try:
            with safe_open(str(weights), "pt") as f:
                if "fc.weight" in f.keys() and isinstance(ids, list) and ids:
                    raw["target_hidden_size"] = f.get_slice("fc.weight").get_shape()[1] // len(ids)
        except (SafetensorError, OSError):
            pass  # reported with its file name by _read_tensors
    return DFlashDrafterConfig.from_dict(raw, source=str(file))


def _read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(weights), "pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {e}") from None


def check_state_dict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source: str) -> None:
    """Every name present, none unexpected, shapes equal, values finite: or one error naming them all."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [f"{n}: checkpoint {tuple(found[n].shape)} vs model {tuple(expected[n].shape)}"
                 for n in expected if n in found and found[n].shape != expected[n].shape]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if misshaped:
        problems.append("mis-shaped tensors [" + "; ".join(misshaped) + "]")
    mistyped = [f"{n}: {str(found[n].dtype).removeprefix('torch.')}" for n in sorted(found)
                if n in expected and not found[n].is_floating_point()]
    if mistyped:
        problems.append("non-floating tensors [" + "; ".join(mistyped) + "]")
    if problems:
        raise CheckpointError(f"{source} does not match the drafter config: " + ", ".join(problems))
    nonfinite = sorted(n for n, t in found.items() if t.is_floating_point() and not torch.isfinite(t).all())
    if nonfinite:
        raise CheckpointError(f"{source} holds non-finite values (NaN/inf) in {nonfinite}")


def load_drafter(path, *, device="cpu", dtype=None) -> DFlashLagunaDrafter:
    """Build a DFlashLagunaDrafter from a vLLM-layout checkpoint directory."""
    device, dtype = resolve_device_and_dtype(device, dtype, "load_drafter")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter checkpoint directory {path} does not exist")
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        shards = sorted(path.glob("*.safetensors"))
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles and not shards:
            raise CheckpointError(
                f"{path} holds pickled weights {pickles}; only safetensors are loaded "
                "(pickles can run code). Convert them to model.safetensors first."
            )
        if len(shards) != 1:
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in drafter checkpoint {path}")
        weights = shards[0]
    config = _read_config(path, weights)
    found = _read_tensors(weights)
    with torch.device("meta"):
        expected = DFlashLagunaDrafter(config).state_dict()
    check_state_dict(expected, found, str(weights))
    drafter = DFlashLagunaDrafter(config)
    drafter.load_state_dict(found, strict=True)
    dtype = dtype or next(iter(found.values())).dtype
    return drafter.to(device=device, dtype=dtype).eval()
