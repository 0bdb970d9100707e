"""Shared fixtures for the unit tests."""

from __future__ import annotations

import pytest

from dflash_lab.repro import block_network, set_offline_env

# Offline before anything imports huggingface_hub (it reads these at import).
set_offline_env()


@pytest.fixture(autouse=True)
def _no_network():
    """Every test runs with only loopback connections allowed (JupyterLab, gloo)."""
    with block_network():
        yield


# ---------------------------------------------------------------------------
# Drafter fixtures: a small valid config and drafters with random weights
# ---------------------------------------------------------------------------

import copy  # noqa: E402

import torch  # noqa: E402

SMALL_DRAFTER_CONFIG = {
    "architectures": ["DFlashLagunaForCausalLM"],
    "model_type": "laguna",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"],
    "draft_vocab_size": 128,
    "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 5, "block_size": 4},
    "target_layer_count": 6,
    "sliding_window": 8,
    "rms_norm_eps": 1e-6,
}


def randomize_drafter(drafter, seed: int = 0, *, scale: float = 0.05, norm_spread: float = 0.25):
    """Random weights everywhere, norm weights included (1 + norm_spread * noise).

    Non-trivial norm weights make folding a norm weight into a projection matter;
    a spread of 0.25 keeps K close to unit RMS after K-norm, which the bf16
    tolerances assume (a K value in [4, 8) already has a bf16 step of 0.03).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + norm_spread * noise if p.dim() == 1 else scale * noise)
    return drafter


@pytest.fixture
def drafter_config_dict():
    """Factory: the small valid config dict, with top-level keys overridden."""

    def make(**overrides) -> dict:
        d = copy.deepcopy(SMALL_DRAFTER_CONFIG)
        d.update(copy.deepcopy(overrides))
        return d

    return make


@pytest.fixture
def make_drafter(drafter_config_dict):
    """Factory: a DFlashLagunaDrafter with random non-trivial weights.

    ``layers`` drafter layers of ``layer_type`` (full: partial rotary 0.5,
    sliding: 1.0, Laguna's defaults), ``gating`` True/"per-head"/"per-element".
    """
    from dflash_lab.config import DFlashDrafterConfig
    from dflash_lab.drafter import DFlashLagunaDrafter

    def make(layers: int = 2, layer_type: str = "full_attention", gating=True, *, seed: int = 0,
             dtype: torch.dtype = torch.float32, **overrides):
        d = drafter_config_dict(num_hidden_layers=layers, layer_types=[layer_type] * layers, gating=gating, **overrides)
        drafter = randomize_drafter(DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(d)), seed)
        return drafter.to(dtype).eval()

    return make


# vLLM picks its platform once, on first use: make it the CPU platform for every
# test module (the interop and KV-group tests run vLLM on the CPU), unless the
# caller chose otherwise. The Makefile exports the same.
import os  # noqa: E402

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture
def interpreted(tmp_path):
    """Run a script in Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, the fused switch on, from
    the repository root) and return the JSON its last line prints."""
    import json
    import subprocess
    import sys

    def run(script: str, name: str = "interpreted.py"):
        path = tmp_path / name
        path.write_text(script)
        env = dict(os.environ, TRITON_INTERPRET="1", DFLASH_LAB_FUSED="1")
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=1500,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run
