"""The files of a checkpoint pair, checked before anything loads.

A researcher's target is usually saved by transformers' ``save_pretrained``: several
safetensors shards and ``model.safetensors.index.json`` naming which shard holds each
tensor. ``weight_files`` lists what a directory's weights are (the index's shards, or its
one ``*.safetensors`` file); ``check_pair_files`` reads every header and both configs and
raises one clear error naming the file and the key when something would fail later: a
missing shard, an index naming a file that is not there, a truncated or unreadable shard,
a tensor the index places in a shard that lacks it, a config vLLM would refuse, a drafter
whose vocabulary, hidden size or layer ids do not fit the target. Nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"


class PairFileError(ValueError):
    """A checkpoint directory whose files cannot be loaded; the message names the file (and key)."""


def _read_json(file: Path) -> dict:
    try:
        out = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise PairFileError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise PairFileError(f"{file} must hold a JSON object, got {type(out).__name__}")
    return out


def _index(directory: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard file name), or None without an index."""
    file = directory / INDEX_NAME
    if not file.is_file():
        return None
    weight_map = _read_json(file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PairFileError(f"{file}: key `weight_map` must be a non-empty object (tensor name -> shard file)")
    bad = sorted({v for v in weight_map.values() if not isinstance(v, str) or "/" in v or v.startswith(".")})
    if bad:
        raise PairFileError(f"{file}: `weight_map` names shard files outside {directory}: {bad}")
    return weight_map


def weight_files(directory) -> list[Path]:
    """The weight files of a checkpoint directory, in name order: the shards its index names, else its one
    ``*.safetensors`` file. Several files without an index, or an index naming a missing file, are errors."""
    directory = Path(directory)
    weight_map = _index(directory)
    if weight_map is not None:
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise PairFileError(f"{directory / INDEX_NAME} names shard file(s) {missing} that are not in {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {pickles}: pickled weights are refused)" if pickles else ""
        raise PairFileError(f"no *.safetensors weights in {directory}{hint}")
    if len(files) > 1:
        raise PairFileError(f"{directory} holds {len(files)} safetensors files {[f.name for f in files]} but no "
                            f"{INDEX_NAME} saying which tensor is in which")
    return files


def shard_tensor_names(file: Path) -> set[str]:
    """The tensor names in one safetensors file, after checking that its header and data are whole."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt", device="cpu") as f:
            return set(f.keys())  # opening checks the header against the file's length
    except (SafetensorError, OSError, RuntimeError) as e:
        raise PairFileError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def check_weights(directory) -> list[Path]:
    """Every weight file of ``directory`` readable, and each tensor where the index says it is."""
    directory = Path(directory)
    files = weight_files(directory)
    found = {f.name: shard_tensor_names(f) for f in files}
    weight_map = _index(directory)
    if weight_map is not None:
        misplaced = sorted(n for n, shard in weight_map.items() if n not in found[shard])
        if misplaced:
            shown = ", ".join(f"{n} (in {weight_map[n]})" for n in misplaced[:5])
            raise PairFileError(f"{directory / INDEX_NAME} places tensors in shards that do not hold them: {shown}"
                                + (f" and {len(misplaced) - 5} more" if len(misplaced) > 5 else ""))
    return files


def target_config(directory):
    """The target's ``LagunaConfig`` from ``directory/config.json``, refused with the file named if transformers
    refuses it or it is not a Laguna config."""
    from transformers import LagunaConfig

    file = Path(directory) / "config.json"
    if not file.is_file():
        raise PairFileError(f"no target config.json in {directory}")
    raw = _read_json(file)
    if raw.get("model_type") != "laguna":
        raise PairFileError(f"{file}: key `model_type` is {raw.get('model_type')!r}; the lab's target is Laguna")
    try:
        return LagunaConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, TypeError, KeyError) as e:
        raise PairFileError(f"{file} is refused by transformers' LagunaConfig: {e}") from None


def check_pair_files(target_dir, drafter_dir) -> None:
    """Both configs and every weight file, and the drafter against the target: one clear error or nothing."""
    from .config import DFlashDrafterConfig

    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    cfg = target_config(target_dir)
    check_weights(target_dir)
    drafter = DFlashDrafterConfig.from_pretrained(drafter_dir)
    drafter.validate_against_target(cfg)
    check_weights(drafter_dir)
