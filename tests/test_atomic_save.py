"""A failure while saving leaves the previous checkpoint intact and no temporary directory behind."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash_lab import checkpoint, runtime
from dflash_lab.checkpoint import load_drafter, save_drafter
from dflash_lab.runtime import atomic_directory
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter

CONFIG = {
    "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "intermediate_size": 64, "layer_types": ["full_attention"], "draft_vocab_size": 128,
    "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 3, "block_size": 4},
}


def drafter(seed: int) -> DFlashLagunaDrafter:
    torch.manual_seed(seed)
    return DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(CONFIG))


def same_weights(a: DFlashLagunaDrafter, b: DFlashLagunaDrafter) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Boom(RuntimeError):
    pass


def half_written_weights(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"\0" * 100)  # a partial file, as a crash or a full disk would leave
    raise Boom("disk full")


def failing_json(*args, **kwargs):
    raise Boom("cannot serialise config")


def interrupted(tensors, filename, metadata=None):
    raise KeyboardInterrupt


def failing_second_replace():
    """os.replace that fails when moving the new directory into place (after the old one moved aside)."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise Boom("rename failed")
        return real(src, dst)

    return replace


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    "target, fault, raises",
    [
        ("save_file", half_written_weights, Boom),
        ("json.dumps", failing_json, Boom),
        ("save_file", interrupted, KeyboardInterrupt),
        ("os.replace", None, Boom),
    ],
    ids=["weights-write-fails", "config-write-fails", "interrupted", "rename-fails"],
)
def test_a_failed_save_keeps_the_previous_checkpoint(target, fault, raises, tmp_path, monkeypatch):
    out = tmp_path / "drafter"
    old = drafter(seed=0)
    save_drafter(old, out)
    config_before = (out / "config.json").read_text()
    fault = fault or failing_second_replace()
    if target == "save_file":
        monkeypatch.setattr(checkpoint, "save_file", fault)
    elif target == "json.dumps":
        monkeypatch.setattr(checkpoint.json, "dumps", fault)
    else:
        monkeypatch.setattr(runtime.os, "replace", fault)

    with pytest.raises(raises):
        save_drafter(drafter(seed=1), out)
    monkeypatch.undo()

    assert leftovers(tmp_path) == [], "a temporary or backup directory was left behind"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == config_before
    assert same_weights(load_drafter(out), old)


def test_a_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "save_file", half_written_weights)
    with pytest.raises(Boom):
        save_drafter(drafter(seed=0), tmp_path / "drafter")
    assert list(tmp_path.iterdir()) == []


def test_a_successful_save_replaces_the_checkpoint_and_cleans_up(tmp_path):
    out = tmp_path / "drafter"
    save_drafter(drafter(seed=0), out)
    new = drafter(seed=1)
    save_drafter(new, out)
    assert leftovers(tmp_path) == []
    assert same_weights(load_drafter(out), new)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashLagunaForCausalLM"]


def test_atomic_directory_never_shows_a_partial_directory(tmp_path):
    seen = []

    def write(tmp):
        (tmp / "a").write_text("1")
        seen.append((tmp_path / "out").exists())  # the final name does not exist while writing
        (tmp / "b").write_text("2")

    atomic_directory(tmp_path / "out", write)
    assert seen == [False] and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a", "b"]


# --- the other writers: report pages, benchmark results, training outputs ------------


def report_page(path, value):
    from dflash_lab.tools.report import write_atomic

    write_atomic(path, value)


def bench_results(path, value):
    from dflash_lab.tools.bench_common import write_results

    write_results(path.parent, path.stem, {"value": value})


def training_log(path, value):
    from dflash_lab.train import write_log

    write_log(path, {"value": value})


def heldout_prompts(path, value):
    from dflash_lab.corpus import save_prompts

    save_prompts([{"text": value}], path)


def distill_data(path, value):
    import numpy as np

    from dflash_lab.train import save_distill_data

    save_distill_data({16: np.full((2, 16), len(value), dtype=np.uint16)}, path)


def raise_boom(*args, **kwargs):
    raise Boom("disk full or rename failed")


def half_write_text(self, data, *args, **kwargs):
    with open(self, "w") as f:
        f.write(data[: len(data) // 2])
    raise Boom("disk full")


WRITERS = [
    (report_page, "index.html"),
    (bench_results, "acceptance.json"),
    (training_log, "training_log.json"),
    (heldout_prompts, "heldout_prompts.json"),
    (distill_data, "distill.safetensors"),
]


@pytest.mark.parametrize("writer, name", WRITERS, ids=[w.__name__ for w, _ in WRITERS])
@pytest.mark.parametrize("fault", ["write-fails", "rename-fails"])
def test_a_failed_file_write_keeps_the_previous_file(writer, name, fault, tmp_path, monkeypatch):
    path = tmp_path / name
    writer(path, "old")
    before = path.read_bytes()
    if fault == "write-fails":  # each writer's way of writing bytes fails half-way
        monkeypatch.setattr("pathlib.Path.write_text", half_write_text)
        monkeypatch.setattr(os, "fsync", raise_boom)  # the report writes through a file descriptor
        monkeypatch.setattr("safetensors.numpy.save_file", half_written_weights)
    else:
        monkeypatch.setattr(os, "replace", raise_boom)

    with pytest.raises(Boom):
        writer(path, "newer")
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "a temporary file was left behind"
