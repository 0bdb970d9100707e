"""The drafter: three context-K/V paths that agree, and the block forward's visibility rules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dflash_lab.context_kv import CONTEXT_KV_PATHS, context_kv_agreement, context_kv_tolerance
from dflash_lab.drafter import SlotKV, dflash_attention_mask, with_window

FAST_PATHS = [p for p in CONTEXT_KV_PATHS if p != "reference"]
LAYER_FLAVOURS = [  # (layer type, its partial rotary factor in Laguna's defaults)
    pytest.param("full_attention", 0.5, id="full-rotary0.5"),
    pytest.param("sliding_attention", 1.0, id="sliding-rotary1.0"),
]
GATINGS = [pytest.param(True, id="gate-per-head"), pytest.param("per-element", id="gate-per-element")]


def context(n: int, hidden: int = 64, *, seed: int = 1, dtype=torch.float32, start: int = 0):
    """Random context states with a non-unit scale, and their positions."""
    g = torch.Generator().manual_seed(seed)
    states = 3.0 * torch.randn(n, hidden, generator=g) + 0.5
    return states.to(dtype), torch.arange(start, start + n)


# --- the three paths agree --------------------------------------------------------


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("layer_type,rotary_factor", LAYER_FLAVOURS)
@pytest.mark.parametrize("layers", [1, 3, 5])
@pytest.mark.parametrize("n_ctx", [1, 37, 160])
def test_context_kv_paths_agree_in_float32(make_drafter, layers, layer_type, rotary_factor, gating, n_ctx):
    drafter = make_drafter(layers, layer_type, gating, seed=layers)
    assert drafter.config.rotary_dim == int(drafter.config.head_dim * rotary_factor)
    states, positions = context(n_ctx, start=5)
    ref = drafter.precompute_context_kv(states, positions, path="reference")
    L, nkv, hd = layers, drafter.config.num_key_value_heads, drafter.config.head_dim
    assert [tuple(t.shape) for t in ref] == [(L, n_ctx, nkv, hd)] * 2
    for path in FAST_PATHS:
        out = drafter.precompute_context_kv(states, positions, path=path)
        assert [tuple(t.shape) for t in out] == [(L, n_ctx, nkv, hd)] * 2
        agreement = context_kv_agreement(out, ref)
        assert agreement["max_err"] <= 1e-5, (path, agreement["max_err"])


@pytest.mark.parametrize("layer_type,rotary_factor", LAYER_FLAVOURS)
@pytest.mark.parametrize("layers", [1, 3, 5])
@pytest.mark.parametrize("n_ctx", [16, 200])
def test_context_kv_paths_agree_in_bfloat16(make_drafter, layers, layer_type, rotary_factor, n_ctx):
    drafter = make_drafter(layers, layer_type, seed=10 + layers, dtype=torch.bfloat16)
    states, positions = context(n_ctx, dtype=torch.bfloat16, start=3)
    ref = drafter.precompute_context_kv(states, positions, path="reference")
    # The same (bf16-rounded) weights and inputs in float32: what every bf16 path approximates.
    truth = make_drafter(layers, layer_type, seed=10 + layers, dtype=torch.bfloat16).float().precompute_context_kv(
        states.float(), positions, path="reference")
    assert all(t.dtype == torch.bfloat16 for t in ref)
    for path in CONTEXT_KV_PATHS:
        out = drafter.precompute_context_kv(states, positions, path=path)
        for against, expected in [("bf16 reference", ref), ("float32", truth)]:
            agreement = context_kv_agreement(out, expected)  # the worse of K and V
            assert agreement["max_err"] <= 6e-2 and agreement["mean_err"] <= 5e-3, (
                path, against, agreement["max_err"], agreement["mean_err"])


def test_context_k_has_unit_rms_before_its_norm_weight(make_drafter):
    # K-norm makes every head vector unit-RMS, then scales by k_norm.weight; RoPE keeps norms.
    drafter = make_drafter(2, "sliding_attention")
    for layer in drafter.layers:
        layer.self_attn.k_norm.weight.data.fill_(1.0)
    k, _ = drafter.precompute_context_kv(*context(20), path="folded")
    torch.testing.assert_close(k.pow(2).mean(-1), torch.ones(k.shape[:-1]), atol=1e-4, rtol=0)


def edit_weights_in_place(drafter):
    with torch.no_grad():
        drafter.layers[1].input_layernorm.weight.mul_(2.0)
        drafter.layers[0].self_attn.qkv_proj.weight.add_(0.01)


@pytest.mark.parametrize("how", ["load_state_dict", "train", "to", "refresh"])
def test_fast_paths_follow_weight_updates(make_drafter, how):
    # The stacked/folded buffers are built once (as vLLM builds them after loading) and dropped
    # whenever the weights may change: a new state dict, train mode, a move, or by hand.
    drafter = make_drafter(2)
    states, positions = context(9)
    drafter.precompute_context_kv(states, positions, path="folded")
    if how == "load_state_dict":
        other = make_drafter(2, seed=7)
        drafter.load_state_dict(other.state_dict())
    else:
        edit_weights_in_place(drafter)
        {"train": lambda: drafter.train(), "to": lambda: drafter.to(torch.float32),
         "refresh": drafter.refresh_context_kv_buffers}[how]()
    ref = drafter.precompute_context_kv(states, positions, path="reference")
    for path in FAST_PATHS:
        agreement = context_kv_agreement(drafter.precompute_context_kv(states, positions, path=path), ref)
        assert agreement["max_err"] <= 1e-5, (how, path, agreement["max_err"])


def test_an_in_place_edit_needs_a_refresh_as_in_vllm(make_drafter):
    # vLLM builds its stacked buffers once after loading; so does the lab. Editing weights in
    # place under no_grad and NOT refreshing leaves the fast paths on the old weights.
    drafter = make_drafter(2).eval()
    states, positions = context(9)
    before = drafter.precompute_context_kv(states, positions, path="folded")
    edit_weights_in_place(drafter)
    stale = drafter.precompute_context_kv(states, positions, path="folded")
    assert torch.equal(stale[0], before[0])
    drafter.refresh_context_kv_buffers()
    assert not torch.allclose(drafter.precompute_context_kv(states, positions, path="folded")[0], before[0])


def _stacked_keys(drafter):
    return [k for k in drafter.context_kv_buffers if k[0] == "linears"]


def test_the_fast_paths_projections_run_as_one_gemm_and_follow_weight_updates(make_drafter):
    # The static path passes ops=triton_ops, whose ``linears`` runs qkv|g and gate|up as one GEMM
    # each over weights concatenated once, kept with the other stacked buffers: the same hidden
    # states as one GEMM per projection, rebuilt after a refresh, never used under autograd.
    from dflash_lab.layers import TorchOps
    from dflash_lab.spec_decode.fast import triton_ops

    drafter = make_drafter(2)
    block, positions, k, v, cpos = draft_block(drafter)
    with torch.no_grad():
        plain = drafter(block, positions, k, v, cpos, ops=TorchOps)
        fused = drafter(block, positions, k, v, cpos, ops=triton_ops)
    assert torch.allclose(fused, plain, atol=1e-5, rtol=1e-5)
    assert len(_stacked_keys(drafter)) == 2 * len(drafter.layers)  # qkv|g and gate|up per layer
    edit_weights_in_place(drafter)
    drafter.refresh_context_kv_buffers()
    assert not _stacked_keys(drafter)
    with torch.no_grad():
        edited = drafter(block, positions, k, v, cpos, ops=TorchOps)
        assert torch.allclose(drafter(block, positions, k, v, cpos, ops=triton_ops), edited, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)  # the edit mattered
    drafter.train()
    drafter(block, positions, k, v, cpos, ops=triton_ops).sum().backward()
    assert not _stacked_keys(drafter)  # a concatenated copy would cut the gradient
    assert drafter.layers[0].self_attn.g_proj.weight.grad is not None
    assert drafter.layers[0].mlp.up_proj.weight.grad is not None


def test_agreement_reports_the_worse_of_k_and_v_and_applies_the_tolerance():
    k, v = torch.ones(2, 3, 1, 4), torch.zeros(2, 3, 1, 4)
    same = context_kv_agreement((k, v), (k, v))
    assert same["ok"] and same["max_err"] == 0.0 and same["mean_tol"] is None
    off = v.clone()
    off[1, 2, 0, 3] = 1e-3  # one V entry, far past float32's 1e-5
    agreement = context_kv_agreement((k, off), (k, v))
    assert not agreement["ok"]
    assert agreement["max_err"] == pytest.approx(1e-3) and agreement["max_tol"] == 1e-5
    assert [e.shape for e in agreement["errors"]] == [k.shape, v.shape]
    bf16 = context_kv_agreement((k.bfloat16(), off.bfloat16()), (k.bfloat16(), v.bfloat16()))
    assert bf16["ok"] and (bf16["max_tol"], bf16["mean_tol"]) == context_kv_tolerance(torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match="shape"):
        context_kv_agreement((k, v[:1]), (k, v))


def test_context_kv_module_does_not_import_the_drafter():
    """context_kv sits below the drafter: importing it must not pull drafter.py in (no cycle)."""
    code = "import sys, dflash_lab.context_kv; print('dflash_lab.drafter' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_views_of_one_drafter_share_the_context_kv_buffers(make_drafter):
    from dflash_lab.context_kv import build_context_kv_buffers
    from dflash_lab.drafter import with_window

    drafter = make_drafter(2)
    bufs = build_context_kv_buffers(drafter, torch.device("cpu"), torch.float32)
    assert build_context_kv_buffers(with_window(drafter, 4), torch.device("cpu"), torch.float32) is bufs
    assert build_context_kv_buffers(drafter, torch.device("cpu"), torch.bfloat16) is not bufs


def test_unknown_path_and_bad_shapes_are_rejected(make_drafter):
    drafter = make_drafter(1)
    states, positions = context(4)
    with pytest.raises(ValueError, match="path must be one of"):
        drafter.precompute_context_kv(states, positions, path="fused")
    with pytest.raises(ValueError, match=r"context must be \(N, 64\)"):
        drafter.precompute_context_kv(states[:, :32], positions)
    with pytest.raises(ValueError, match=r"positions must be \(4,\)"):
        drafter.precompute_context_kv(states, positions[:3])


# --- combine_hidden_states ------------------------------------------------------------


def test_combine_hidden_states_matches_a_hand_computation(make_drafter):
    drafter = make_drafter(1)
    cfg, eps = drafter.config, drafter.config.rms_norm_eps
    aux = 4.0 * torch.randn(6, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=torch.Generator().manual_seed(3))
    x = aux.double().view(6, len(cfg.target_layer_ids), cfg.target_hidden_size)
    w = torch.stack([n.weight.double() for n in drafter.aux_hidden_norms])  # (n_aux, H_t)
    normed = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w  # each slice with its own norm
    projected = normed.flatten(1) @ drafter.fc.weight.double().T
    expected = projected / (projected.pow(2).mean(-1, keepdim=True) + eps).sqrt() * drafter.hidden_norm.weight.double()
    got = drafter.combine_hidden_states(aux)
    assert got.shape == (6, cfg.hidden_size)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_combine_hidden_states_rejects_the_wrong_width(make_drafter):
    drafter = make_drafter(1)
    with pytest.raises(ValueError, match="expected 2 target layers x hidden 64 = 128"):
        drafter.combine_hidden_states(torch.zeros(3, 64))


# --- naming ---------------------------------------------------------------------------


def test_drafter_layers_are_named_after_the_target_layers(make_drafter):
    drafter = make_drafter(3)  # target_layer_count 6 in the config
    assert drafter.attention_layer_names() == [f"model.layers.{6 + j}.self_attn.attn" for j in range(3)]


def test_layer_names_default_to_one_past_the_deepest_target_layer(make_drafter):
    drafter = make_drafter(2, target_layer_count=None)  # target_layer_ids [1, 3]
    assert drafter.attention_layer_names() == ["model.layers.4.self_attn.attn", "model.layers.5.self_attn.attn"]


# --- the block forward: what a block query sees -------------------------------------------


def draft_block(drafter, ctx_len=12, block_size=4, *, seed=2, block_start=None):
    """Inputs of one block: a K/V store of positions 0..ctx_len-1 and a block at
    block_start (default: right after the context)."""
    g = torch.Generator().manual_seed(seed)
    H = drafter.config.hidden_size
    cpos = torch.arange(ctx_len)
    k, v = drafter.precompute_context_kv(torch.randn(ctx_len, H, generator=g), cpos)
    block = torch.randn(1, block_size, H, generator=g)
    start = ctx_len if block_start is None else block_start
    positions = torch.arange(start, start + block_size)[None]
    return block, positions, k, v, cpos


def run(drafter, block, positions, k, v, cpos, store="concat"):
    """One block through the drafter, its context K/V held by either K/V store.

    "concat": beside the block (eager loop, training); "slots": written at slot == position of
    a preallocated buffer larger than needed, stale slots past the context filled with noise
    (the static/graphed path). Both must give the same hidden states.
    """
    with torch.no_grad():
        if store == "concat":
            return drafter(block, positions, k, v, cpos)
        L, N, nkv, hd = k.shape
        S = int(positions.max()) + 9
        buffers = [torch.full((L, 1, S, nkv, hd), 1e3), torch.full((L, 1, S, nkv, hd), -1e3)]  # never seen
        slots = SlotKV(*buffers)
        slots.write(cpos[None], k[:, None], v[:, None])
        return drafter(block, positions, kv=slots)


STORES = ["concat", "slots"]


CAUSALITY_CASES = [  # (layer type, config override, causal inside the block?) — vLLM's _dflash_layer_causal
    pytest.param("full_attention", {}, False, id="full-default-non-causal"),
    pytest.param("sliding_attention", {}, True, id="sliding-default-causal"),
    pytest.param("sliding_attention", {"is_causal": False}, False, id="sliding-is_causal-false"),
    pytest.param("sliding_attention", {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 5,
                                                          "block_size": 4, "causal": False}}, False,
                 id="sliding-dflash_config-causal-false"),
    pytest.param("full_attention", {"is_causal": True}, True, id="full-is_causal-true"),
]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("layer_type,override,causal", CAUSALITY_CASES)
def test_block_query_sees_later_block_tokens_only_when_non_causal(make_drafter, layer_type, override, causal, gating,
                                                                  store):
    """A causal drafter's block query i does not change when block tokens after i change."""
    drafter = make_drafter(2, layer_type, gating, sliding_window=64, **override)
    assert drafter.config.is_causal is causal
    block, positions, k, v, cpos = draft_block(drafter)
    out = run(drafter, block, positions, k, v, cpos, store)
    assert out.shape == block.shape
    if store == "slots":
        torch.testing.assert_close(out, run(drafter, block, positions, k, v, cpos), atol=1e-5, rtol=1e-5)
    for j in range(1, block.shape[1]):
        changed = block.clone()
        changed[0, j] += 1.0  # block token j
        delta = (run(drafter, changed, positions, k, v, cpos, store) - out).abs().amax(-1)[0]  # (Q,)
        assert (delta[j:] > 1e-4).all(), "a changed token must reach its own and later positions"
        if causal:
            assert (delta[:j] == 0).all(), f"causal: queries before {j} must not see token {j}"
        else:
            assert (delta[:j] > 1e-4).all(), f"non-causal: every query sees token {j}"


@pytest.mark.parametrize("store", STORES)
def test_context_at_or_after_the_block_start_is_never_seen(make_drafter, store):
    drafter = make_drafter(2, "full_attention")
    # The K/V store holds positions 0..15, the block starts at 12: 12..15 are the
    # block's own positions and must come from the block, never from the store.
    block, positions, k, v, cpos = draft_block(drafter, ctx_len=16, block_start=12)
    out = run(drafter, block, positions, k, v, cpos, store)
    k2, v2 = k.clone(), v.clone()
    k2[:, 12:] = 50.0
    v2[:, 12:] = -50.0
    torch.testing.assert_close(run(drafter, block, positions, k2, v2, cpos, store), out, atol=0, rtol=0)
    k2[:, 11] += 1.0  # control: the last context position before the block IS seen
    assert (run(drafter, block, positions, k2, v2, cpos, store) - out).abs().max() > 1e-4


@pytest.mark.parametrize("store", STORES)
def test_sliding_window_hides_context_outside_the_window(make_drafter, store):
    window = 8
    drafter = make_drafter(2, "sliding_attention", sliding_window=window)
    block, positions, k, v, cpos = draft_block(drafter, ctx_len=20)  # block at 20..23
    out = run(drafter, block, positions, k, v, cpos, store)
    # The first query (position 20) sees context 13..19; later queries see less.
    outside, inside = 20 - window, 20 - window + 1
    k2, v2 = k.clone(), v.clone()
    k2[:, : outside + 1] += 3.0
    v2[:, : outside + 1] -= 3.0
    torch.testing.assert_close(run(drafter, block, positions, k2, v2, cpos, store), out, atol=0, rtol=0)
    k3 = k.clone()
    k3[:, inside] += 3.0
    assert (run(drafter, block, positions, k3, v, cpos, store) - out).abs().max() > 1e-4
    # The same change outside the window is seen once the window is lifted.
    unwindowed = with_window(drafter, None)
    full = run(unwindowed, block, positions, k, v, cpos, store)
    assert (run(unwindowed, block, positions, k2, v2, cpos, store) - full).abs().max() > 1e-4


def test_attention_mask_layout():
    # Two blocks of 3 at positions 4..6 and 7..9 over a context of positions 0..6.
    positions = torch.arange(4, 10)[None]
    mask = dflash_attention_mask(positions, torch.arange(7), block_size=3)
    ctx, blk = mask[0, :, :7], mask[0, :, 7:]
    assert ctx[:3].tolist() == [[True] * 4 + [False] * 3] * 3  # block 1 sees context before 4
    assert ctx[3:].tolist() == [[True] * 7] * 3  # block 2 sees context before 7
    assert blk.tolist() == [[i // 3 == j // 3 for j in range(6)] for i in range(6)]  # own block, both directions
    windowed = dflash_attention_mask(positions, torch.arange(7), block_size=3, window=2)[0, :, :7]
    assert windowed[0].nonzero().flatten().tolist() == [3]  # query at 4 sees only position 3
    causal = dflash_attention_mask(positions, torch.arange(7), block_size=3, causal=True)[0, :, 7:]
    assert causal.tolist() == [[i // 3 == j // 3 and j <= i for j in range(6)] for i in range(6)]
    with pytest.raises(ValueError, match="not a multiple of block_size 4"):
        dflash_attention_mask(positions, torch.arange(7), block_size=4)


def test_window_is_one_sided_for_causal_and_symmetric_for_non_causal_layers():
    """vLLM: a causal layer's window is (w, 0); a non-causal one's becomes (w, w) (_maybe_symmetrize_window)."""
    positions = torch.arange(10, 18)[None]  # one block of 8 at 10..17, context 0..9
    sym = dflash_attention_mask(positions, torch.arange(10), block_size=8, window=3)[0, :, 10:]
    one_sided = dflash_attention_mask(positions, torch.arange(10), block_size=8, window=3, causal=True)[0, :, 10:]
    assert sym.tolist() == [[abs(i - j) < 3 for j in range(8)] for i in range(8)]
    assert one_sided.tolist() == [[0 <= i - j < 3 for j in range(8)] for i in range(8)]


# --- on a GPU ------------------------------------------------------------------------------


@pytest.fixture
def no_tf32():
    """float32 means float32 GEMMs (TF32 would round inputs to 10 mantissa bits)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer_type,rotary_factor", LAYER_FLAVOURS)
@pytest.mark.parametrize("layers", [1, 5])
def test_context_kv_paths_agree_on_cuda(make_drafter, layers, layer_type, rotary_factor, no_tf32):
    cpu = make_drafter(layers, layer_type, seed=20 + layers)
    states, positions = context(1000, start=7)
    cpu_ref = cpu.precompute_context_kv(states, positions, path="reference")
    for dtype, max_tol, mean_tol in [(torch.float32, 1e-5, None), (torch.bfloat16, 6e-2, 5e-3)]:
        drafter = make_drafter(layers, layer_type, seed=20 + layers, dtype=dtype).cuda()
        s, p = states.to("cuda", dtype), positions.cuda()
        ref = drafter.precompute_context_kv(s, p, path="reference")
        if dtype == torch.float32:  # the GPU reference is the CPU reference
            assert context_kv_agreement([t.cpu() for t in ref], cpu_ref)["max_err"] <= 1e-4
        for path in FAST_PATHS:
            out = drafter.precompute_context_kv(s, p, path=path)
            assert all(t.is_cuda and t.dtype == dtype and t.shape == r.shape for t, r in zip(out, ref))
            agreement = context_kv_agreement(out, ref)
            assert agreement["max_err"] <= max_tol, (dtype, path, agreement["max_err"])
            if mean_tol is not None:
                assert agreement["mean_err"] <= mean_tol, (dtype, path, agreement["mean_err"])


def test_bf16_tolerance_is_the_issue_bound_at_unit_scale_and_two_steps_plus_a_margin_past_four():
    assert context_kv_tolerance(torch.bfloat16, 1.0) == (6e-2, 5e-3)
    assert context_kv_tolerance(torch.bfloat16, 7.1) == (3 * 2.0**-5, 5e-3)  # |K| in [4, 8): 2 steps + 1 of margin
    assert context_kv_tolerance(torch.float32, 0.5) == (1e-5, None)
    assert context_kv_tolerance(torch.float32, 8.0)[0] == pytest.approx(8e-5)


def test_paths_agree_on_the_shipped_drafter_in_bfloat16():
    """Trained K-norm weights push |K| past 4; the paths still agree within the package's rule."""
    from dflash_lab.assets import load_default_pair
    from dflash_lab.target import target_forward

    target, drafter, tokenizer = load_default_pair(device="cpu")
    ids = torch.tensor([tokenizer.encode("import os\n\ndef main(argv):\n    for name in argv:\n        print(name)\n")])
    with torch.no_grad():
        context = drafter.combine_hidden_states(target_forward(target, ids, drafter.config.target_layer_ids).aux_hidden[0])
        model = drafter.to(torch.bfloat16)
        positions = torch.arange(ids.shape[1])
        ref = model.precompute_context_kv(context.bfloat16(), positions, path="reference")
        for path in ("batched", "folded"):
            agreement = context_kv_agreement(model.precompute_context_kv(context.bfloat16(), positions, path=path), ref)
            assert agreement["ok"], (path, agreement["max_err"], agreement["mean_err"], agreement["max_tol"])
