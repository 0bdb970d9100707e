"""The fused folded path: the `fused` argument that picks it, and its parity with the reference.

On a CPU the folded path runs in torch (checked here against the reference);
the Triton kernel itself is checked in Triton's CPU interpreter (a subprocess
with TRITON_INTERPRET=1) and, on a GPU, compiled (tests marked ``gpu``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_lab import context_kv_kernel as kernels
from dflash_lab.context_kv import context_kv_agreement

from test_drafter import LAYER_FLAVOURS, context

has_triton = pytest.mark.skipif(kernels.triton is None, reason="needs Triton")


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    """Every test starts from the default: no $DFLASH_LAB_FUSED override."""
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)


# --- the fused argument ------------------------------------------------------------------


def test_fused_kernel_is_off_for_cpu_tensors():
    assert not kernels.fused_available(torch.zeros(2, 3))


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_environment_variable_turns_the_kernel_off(monkeypatch, value):
    monkeypatch.setenv(kernels.ENV_SWITCH, value)
    assert not kernels.fused_enabled()
    assert not kernels.fused_available(None)
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    assert kernels.fused_enabled()


def test_there_is_no_process_wide_switch():
    """Callers say fused= per call; nothing in the module flips it for everyone."""
    assert not hasattr(kernels, "set_fused")
    assert not any(isinstance(v, bool) for k, v in vars(kernels).items() if k.startswith("_") and not k.startswith("__"))


def test_fused_must_be_true_false_or_none(make_drafter):
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        kernels.fused_available(torch.zeros(2, 3), fused="yes")
    drafter = make_drafter(1)
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        drafter.precompute_context_kv(*context(4), path="folded", fused=1)


def test_fused_false_always_picks_torch(make_drafter):
    drafter = make_drafter(2)
    states, positions = context(9)
    ref = drafter.precompute_context_kv(states, positions, path="reference")
    out = drafter.precompute_context_kv(states, positions, path="folded", fused=False)
    assert context_kv_agreement(out, ref)["max_err"] <= 1e-5


@pytest.mark.skipif(kernels.interpreting(), reason="the interpreter runs the kernel on CPU tensors")
def test_insisting_on_the_kernel_for_cpu_tensors_is_an_error(make_drafter):
    drafter = make_drafter(2)
    states, positions = context(4)
    with pytest.raises(RuntimeError, match="fused=True.*cannot run"):
        drafter.precompute_context_kv(states, positions, path="folded", fused=True)


def test_fused_applies_to_the_folded_path_only(make_drafter):
    drafter = make_drafter(1)
    states, positions = context(4)
    with pytest.raises(ValueError, match="folded path only"):
        drafter.precompute_context_kv(states, positions, path="batched", fused=True)


# --- the kernel in Triton's CPU interpreter -------------------------------------------------

INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import SMALL_DRAFTER_CONFIG, randomize_drafter
    from dflash_lab.config import DFlashDrafterConfig
    from dflash_lab.context_kv import context_kv_agreement
    from dflash_lab.drafter import DFlashLagunaDrafter
    results = []
    for layer_type, layers, n, bias in [("full_attention", 3, 37, False), ("sliding_attention", 2, 21, True)]:
        d = dict(SMALL_DRAFTER_CONFIG, num_hidden_layers=layers, layer_types=[layer_type] * layers, attention_bias=bias)
        cfg = DFlashDrafterConfig.from_dict(d)
        for dtype in (torch.float32, torch.bfloat16):
            drafter = randomize_drafter(DFlashLagunaDrafter(cfg), seed=layers).to(dtype)
            g = torch.Generator().manual_seed(n)
            states = (3.0 * torch.randn(n, cfg.hidden_size, generator=g) + 0.5).to(dtype)
            positions = torch.randint(0, 40000, (n,), generator=g)
            with torch.no_grad():
                ref = drafter.precompute_context_kv(states, positions, path="reference")
                out = drafter.precompute_context_kv(states, positions, path="folded", fused=True)
            agreement = context_kv_agreement(out, ref)
            truth = randomize_drafter(DFlashLagunaDrafter(cfg), seed=layers).to(dtype).float().precompute_context_kv(
                states.float(), positions, path="reference")
            err_truth = [[e.mean().item() for e in context_kv_agreement(o, truth)["errors"]] for o in (out, ref)]
            results.append(dict(layer_type=layer_type, dtype=str(dtype), bias=bias, mean_vs_truth=err_truth,
                                shapes_ok=all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(out, ref)),
                                ok=agreement["ok"], max_err=agreement["max_err"], mean_err=agreement["mean_err"]))
    print(json.dumps(results))
""")


@has_triton
def test_kernel_matches_the_reference_in_the_triton_interpreter(tmp_path):
    """The real kernel source, run by Triton's CPU interpreter: both rotary factors, with and without bias."""
    script = tmp_path / "interp.py"
    script.write_text(INTERPRETER_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for r in results:
        assert r["shapes_ok"], r
        assert r["ok"], r  # within the package's rule (context_kv_tolerance)
        if "bfloat16" in r["dtype"]:
            fused, reference = r["mean_vs_truth"]  # as accurate as the reference, against float32
            assert all(f <= 1.25 * g + 1e-4 for f, g in zip(fused, reference)), r


# --- the kernel on a GPU ------------------------------------------------------------------


def assert_matches_reference(drafter, states, positions):
    """fused folded == reference within the package's rule (context_kv_tolerance): fp32 to 1e-5
    of the scale; in bf16 also as accurate as the bf16 reference itself against float32."""
    ref = drafter.precompute_context_kv(states, positions, path="reference")
    out = drafter.precompute_context_kv(states, positions, path="folded", fused=True)
    assert all(o.is_cuda and o.dtype == r.dtype and o.shape == r.shape and o.is_contiguous() for o, r in zip(out, ref))
    assert all(torch.isfinite(o).all() for o in out)
    agreement = context_kv_agreement(out, ref)
    assert agreement["ok"], {k: agreement[k] for k in ("max_err", "mean_err", "max_tol", "mean_tol")}
    if states.dtype == torch.float32:
        return
    truth = copy.deepcopy(drafter).float().precompute_context_kv(states.float(), positions, path="reference")
    fused = [e.mean().item() for e in context_kv_agreement(out, truth)["errors"]]
    reference = [e.mean().item() for e in context_kv_agreement(ref, truth)["errors"]]
    for name, f, r in zip("KV", fused, reference):
        assert f <= 1.25 * r + 1e-4, (name, f, r)


def _gpu_case(make_drafter, layers, layer_type, n, dtype, *, seed=0, hidden=64, **overrides):
    drafter = make_drafter(layers, layer_type, seed=seed, dtype=dtype, **overrides).cuda()
    g = torch.Generator().manual_seed(seed + n)
    states = (3.0 * torch.randn(n, hidden, generator=g) + 0.5).to("cuda", dtype)
    positions = torch.randint(0, 32768, (n,), generator=g).cuda()
    return drafter, states, positions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer_type,rotary_factor", LAYER_FLAVOURS)
@pytest.mark.parametrize("layers", [1, 3, 5, 8])
@pytest.mark.parametrize("n", [1, 37, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_matches_the_reference_on_cuda(make_drafter, layer_type, rotary_factor, layers, n, dtype):
    drafter, states, positions = _gpu_case(make_drafter, layers, layer_type, n, dtype, seed=layers)
    assert kernels.fused_available(states)  # the default on CUDA
    assert_matches_reference(drafter, states, positions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_at_laguna_xs2_shapes(make_drafter, dtype):
    """hidden 2048, 8 KV heads of 128, partial rotary 0.5, a bias, and a strided GEMM output."""
    shapes = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=256, attention_bias=True)
    drafter, states, positions = _gpu_case(make_drafter, 3, "full_attention", 777, dtype, seed=3, hidden=2048,
                                           **shapes)
    with torch.no_grad():  # K/V of about unit scale at this width, as the bf16 tolerances assume
        for layer in drafter.layers:
            layer.self_attn.qkv_proj.weight.mul_(0.2)
            layer.self_attn.qkv_proj.bias.sub_(1).mul_(0.5)
    assert_matches_reference(drafter, states, positions)
    # The epilogue alone reads any row stride: a GEMM output padded to a wider buffer.
    cfg, L = drafter.config, len(drafter.layers)
    width = L * 2 * cfg.num_key_value_heads * cfg.head_dim
    kv = torch.randn(50, width + 64, device="cuda", dtype=dtype)[:, :width]
    knw = torch.rand(L, cfg.head_dim, device="cuda", dtype=dtype) + 0.5
    pos = torch.arange(50, device="cuda")
    k, v = kernels.knorm_rope_split(kv.view(50, L, 2, cfg.num_key_value_heads, cfg.head_dim), knw, pos, cfg)
    assert torch.equal(v, kv.view(50, L, 2, cfg.num_key_value_heads, cfg.head_dim)[:, :, 1].transpose(0, 1))
    assert torch.isfinite(k).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switching_the_kernel_off_on_cuda_uses_torch(make_drafter, monkeypatch):
    drafter, states, positions = _gpu_case(make_drafter, 2, "full_attention", 64, torch.float32)
    assert kernels.fused_available(states)
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert not kernels.fused_available(states)
    assert kernels.fused_available(states, fused=True)  # a per-call True wins over the environment
    monkeypatch.delenv(kernels.ENV_SWITCH)
    assert not kernels.fused_available(states, fused=False)


# --- the window override ------------------------------------------------------------------


def test_with_window_is_the_same_drafter_with_its_attention_cut(make_drafter):
    from dflash_lab.drafter import dflash_attention_mask, with_window

    drafter = make_drafter(2)
    states, positions = context(12)
    k, v = drafter.precompute_context_kv(states, positions)
    g = torch.Generator().manual_seed(0)
    block = torch.randn(1, 4, drafter.config.hidden_size, generator=g)
    block_pos = torch.arange(12, 16)[None]
    windowed = with_window(drafter, 3)
    assert windowed.layers is drafter.layers  # shared weights, nothing copied
    assert isinstance(windowed, type(drafter))
    assert (windowed.window, drafter.window) == (3, drafter.config.window)  # a field; the original keeps its own
    cut = windowed(block, block_pos, k, v, positions)
    by_mask = dflash_attention_mask(block_pos, positions, 4, 3, causal=drafter.config.is_causal)
    assert torch.equal(cut, drafter(block, block_pos, k, v, positions, mask=by_mask))
    assert not torch.allclose(cut, drafter(block, block_pos, k, v, positions))
    assert torch.equal(with_window(windowed, None)(block, block_pos, k, v, positions),
                       drafter(block, block_pos, k, v, positions))
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive integer or None"):
            with_window(drafter, bad)
