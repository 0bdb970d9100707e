"""The static path's routed experts that read only the chosen experts (``spec_decode.fast.moe``).

On the CPU, in float32, the blocked computation must equal ``dense_experts`` (every expert
over every token, then the chosen k) on random routing with experts chosen by several
tokens and experts chosen by none; the Triton kernel itself is checked in Triton's CPU
interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_lab.spec_decode.fast.moe import (
    BLOCK_M, align, block_bound, distinct_experts, gathered_experts, uniform_distinct,
)
from dflash_lab.spec_decode.fast.static_target import MOE_IMPLEMENTATIONS, dense_experts, resolve_moe

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    triton = None


def experts(n_experts=12, hidden=32, width=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(gate_up_proj=torch.randn(n_experts, 2 * width, hidden, generator=g),
                           down_proj=torch.randn(n_experts, hidden, width, generator=g),
                           act_fn=torch.nn.functional.silu)


def routing(tokens, k, pool, seed):
    """Each token picks k distinct experts among the first ``pool`` (so the others get no tokens)."""
    g = torch.Generator().manual_seed(seed)
    selected = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(tokens)])
    return selected, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("tokens,k,pool", [(1, 4, 12), (5, 3, 6), (40, 4, 7), (3, 1, 2), (17, 8, 12)])
def test_gathered_equals_dense_in_float32(tokens, k, pool):
    ex = experts()
    selected, weights = routing(tokens, k, pool, seed=tokens)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1))
    out = gathered_experts(ex, x, selected, weights, kernel=False)
    torch.testing.assert_close(out, dense_experts(ex, x, selected, weights), rtol=1e-5, atol=1e-4)
    assert distinct_experts(selected, 12).item() < 12 or pool == 12  # some experts had no token


def test_align_puts_every_pair_once_in_a_block_of_its_expert():
    selected, _ = routing(23, 4, 9, seed=3)
    n_experts = 12
    row_pair, block_expert, used = align(selected, n_experts)
    P = selected.numel()
    assert row_pair.numel() == block_bound(P, n_experts) * BLOCK_M  # static: a function of N*k and E only
    real = row_pair[row_pair < P]
    assert sorted(real.tolist()) == list(range(P))  # each pair exactly once
    flat = selected.reshape(-1)
    for b in range(int(used)):
        pairs = row_pair[b * BLOCK_M:(b + 1) * BLOCK_M]
        pairs = pairs[pairs < P]
        assert len(pairs) > 0 and bool((flat[pairs] == block_expert[b]).all())
    assert bool((row_pair[int(used) * BLOCK_M:] == P).all())  # blocks past the used ones hold nothing
    assert int(used) == sum(-(-int((flat == e).sum()) // BLOCK_M) for e in range(n_experts))


def test_distinct_experts_and_the_uniform_expectation():
    selected = torch.tensor([[0, 1], [1, 2], [0, 2]])
    assert distinct_experts(selected, 8).item() == 3
    assert distinct_experts(torch.stack([selected, selected + 3]), 8).tolist() == [3, 3]
    assert uniform_distinct(1, 8, 256) == pytest.approx(8)
    grows = [uniform_distinct(b, 8, 256) for b in (1, 4, 8, 16, 64)]
    assert grows == sorted(grows) and grows[-1] < 256  # more tokens share experts, never more than E


def test_auto_is_exact_dense_on_the_cpu():
    assert "gathered" in MOE_IMPLEMENTATIONS
    assert resolve_moe("auto", torch.device("cpu"), torch.float32) == "dense"
    with pytest.raises(ValueError, match="moe must be one of"):
        resolve_moe("sparse", torch.device("cpu"), torch.float32)


INTERPRETER_SCRIPT = """
import json, torch
from types import SimpleNamespace
from dflash_lab.spec_decode.fast.moe import gathered_experts
from dflash_lab.spec_decode.fast.static_target import dense_experts
errs = []
for tokens, k, pool, seed, act in [(1, 4, 12, 0, "silu"), (6, 3, 5, 1, "silu"), (33, 2, 12, 2, "silu"),
                                   (1, 3, 12, 3, "gelu")]:
    g = torch.Generator().manual_seed(seed)
    ex = SimpleNamespace(gate_up_proj=torch.randn(12, 32, 40, generator=g),
                         down_proj=torch.randn(12, 40, 16, generator=g), act_fn=getattr(torch.nn.functional, act))
    sel = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    x = torch.randn(tokens, 40, generator=g)
    ref = dense_experts(ex, x, sel, w)
    out = gathered_experts(ex, x, sel, w, kernel=True)
    errs.append(((out - ref).abs().max() / ref.abs().max()).item())
print(json.dumps(errs))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_kernel_in_the_triton_interpreter(interpreted):
    """The real kernel sources (K not a multiple of their tiles, N_out not a multiple of their tiles), on the
    CPU: the block GEMM at several tokens, the one-token GEMV with SiLU fused and with another activation."""
    errs = interpreted(INTERPRETER_SCRIPT)
    assert len(errs) == 4 and max(errs) < 1e-5


def test_one_token_takes_one_block_per_chosen_expert():
    selected = torch.tensor([[5, 0, 9, 2]])
    row_pair, block_expert, used = align(selected, 12)
    assert int(used) == 4 and block_expert.tolist() == [5, 0, 9, 2]
    rows = row_pair.view(4, BLOCK_M)
    assert rows[:, 0].tolist() == [0, 1, 2, 3] and bool((rows[:, 1:] == 4).all())


# Laguna-XS.2's layer pattern at test widths: per-layer head counts (48/64 scaled down), 1 full : 3 sliding
SMALL_XS2 = dict(num_hidden_layers=5, vocab_size=256, hidden_size=64, intermediate_size=96, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                 moe_intermediate_size=16, shared_expert_intermediate_size=16, sliding_window=8,
                 num_attention_heads_per_layer=[4, 8, 8, 8, 4])


def test_the_static_path_with_laguna_xs2s_layer_pattern_matches_transformers():
    """Per-layer head counts (48/64 scaled down), 1 full : 3 sliding, a dense first layer, YaRN on full layers."""
    from transformers import DynamicCache, LagunaForCausalLM

    from dflash_lab.presets import laguna_xs_2_config
    from dflash_lab.spec_decode.fast.static_target import StaticTarget
    from dflash_lab.target import target_forward

    cfg = laguna_xs_2_config(**SMALL_XS2)
    torch.manual_seed(0)
    model = LagunaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = target_forward(model, ids, [1, 4], past_key_values=DynamicCache())
        st = StaticTarget(model, batch=1, capacity=40, layer_ids=[1, 4])
        pos = torch.arange(30)[None]
        st.forward(ids[:, :20], pos[:, :20])
        logits, aux = st.forward(ids[:, 20:], pos[:, 20:])
    torch.testing.assert_close(logits, ref.logits[:, 20:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref.aux_hidden[:, 20:], rtol=1e-5, atol=1e-5)


ONE_TOKEN_SCRIPT = r"""
import json
import torch
from transformers import DynamicCache, LagunaForCausalLM
from dflash_lab.measure.launches import count_launches
from dflash_lab.presets import laguna_xs_2_config
from dflash_lab.spec_decode.fast.static_target import StaticTarget
from dflash_lab.target import target_forward

from dflash_lab.spec_decode.fast import residual
residual.IN_CONSUMER = False  # each tail its own kernel first; the settings that fold them are compared below
cfg = laguna_xs_2_config(**dict(SMALL_XS2, shared_expert_intermediate_size=24))
torch.manual_seed(0)
model = LagunaForCausalLM(cfg).eval()
ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
out = {}
with torch.no_grad():
    ref = target_forward(model, ids, [1, 4], past_key_values=DynamicCache())
    st = StaticTarget(model, batch=1, capacity=32, layer_ids=[1, 4])
    pos = torch.arange(24)[None]
    st.forward(ids[:, :20], pos[:, :20])
    errs = []
    for t in range(20, 24):  # decode steps of one token: the one-token path (shared expert in the routed launch)
        with count_launches() as c:
            logits, aux = st.forward(ids[:, t:t + 1], pos[:, t:t + 1])
        errs.append(max((logits - ref.logits[:, t:t + 1]).abs().max().item(),
                        (aux - ref.aux_hidden[:, t:t + 1]).abs().max().item()))
out["max_err"] = max(errs)
out["launches"] = {k: v for k, v in c.by_name.items() if k.startswith("triton.")}
# the residual tails inside the one-row launches that produce their deltas (IN_PRODUCER), the attention's add
# and norm inside the MLP's first product that reads them (IN_CONSUMER), and both: the same bits, fewer tails
from dflash_lab.spec_decode.fast import pdl, residual
steps, counted = {}, {}
with torch.no_grad():
    for setting in ("off", "producer", "consumer", "both"):
        residual.IN_PRODUCER = setting in ("producer", "both")
        residual.IN_CONSUMER = setting in ("consumer", "both")
        st = StaticTarget(model, batch=1, capacity=32, layer_ids=[1, 4])
        st.forward(ids[:, :20], pos[:, :20])
        steps[setting] = []
        for t in range(20, 24):
            with count_launches() as c2:
                steps[setting].append(st.forward(ids[:, t:t + 1], pos[:, t:t + 1]))
        counted[setting] = {k: v for k, v in c2.by_name.items() if k.startswith("triton.")}
residual.IN_PRODUCER = residual.IN_CONSUMER = False
for setting in ("producer", "consumer", "both"):
    out[f"in_{setting}_same_bits"] = [bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
                                      for a, b in zip(steps["off"], steps[setting])]
    out[f"in_{setting}_launches"] = counted[setting]
out["counter_left_at_zero"] = int(pdl._COUNTERS[(torch.device("cpu"), "residual tail")].abs().sum()) == 0
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_one_token_of_the_static_path_in_the_interpreter_matches_transformers(interpreted):
    """Decode tokens one at a time through the static path with every kernel on, Laguna-XS.2's pattern (a dense
    first layer, then sparse layers with a shared expert wider than a routed one): transformers' logits and
    aux states to float32 rounding. Each sparse layer's shared expert rides in its routed experts' down GEMV:
    the only silu_mul launch left is the dense layer's MLP, and a sparse layer's products are 5 GEMV launches
    (qkv+gate, o_proj, router | shared gate | up, routed gate/up, routed + shared down); the router runs inside
    the routed gate/up launch, so no router kernel is launched at one token."""
    out = interpreted(ONE_TOKEN_SCRIPT.replace("SMALL_XS2", repr(SMALL_XS2), 1))
    assert out["max_err"] < 1e-4, out
    n = out["launches"]
    assert n.get("triton._silu_mul_kernel", 0) == 1, n
    assert n["triton._pair_gemv_kernel"] == 4 * 5 + 4, n  # 4 sparse layers x 5, the dense layer's 4
    assert "triton._route_kernel" not in n, n
    assert n["triton._residual_norm_kernel"] == 2 * 5, n  # each layer's two tails
    # with the tails in their producers (the o_proj GEMV, the routed + shared down, the dense layer's down):
    # the same logits and aux states bit for bit, every tail kernel gone, nothing else added
    assert out["in_producer_same_bits"] == [True] * 4, out["in_producer_same_bits"]
    fused = out["in_producer_launches"]
    assert "triton._residual_norm_kernel" not in fused, fused
    assert fused == {k: v for k, v in n.items() if k != "triton._residual_norm_kernel"}, (fused, n)
    assert out["counter_left_at_zero"]
    # the attention's add and norm computed by the MLP's first product (every program of the router | shared
    # gate | up GEMV, the dense layer's gate | up): the same bits, one tail kernel a layer (the MLP's) left;
    # with the producers' tails too, none
    for setting, tails in (("consumer", 5), ("both", 0)):
        assert out[f"in_{setting}_same_bits"] == [True] * 4, (setting, out[f"in_{setting}_same_bits"])
        got = out[f"in_{setting}_launches"]
        assert got.get("triton._residual_norm_kernel", 0) == tails, (setting, got)
        assert {k: v for k, v in got.items() if k != "triton._residual_norm_kernel"} == \
            {k: v for k, v in n.items() if k != "triton._residual_norm_kernel"}, (setting, got, n)


ROUTER_SCRIPT = r"""
import json
import torch
from types import SimpleNamespace
from dflash_lab.spec_decode.fast.moe import fused_route, one_token_experts, routed_one_token
from dflash_lab.spec_decode.fast.static_target import route

out = []
for tokens, E, k, dtype, seed in [(1, 256, 8, torch.bfloat16, 0), (5, 12, 3, torch.float32, 1),
                                  (7, 8, 1, torch.float32, 2),
                                  (3, 8, 8, torch.float32, 3)]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, E + 9, generator=g).to(dtype)  # the router's columns of a wider GEMM output
    logits = wide[:, 2:2 + E]
    router = SimpleNamespace(e_score_correction_bias=torch.randn(E, generator=g) * 0.1, top_k=k,
                             router_logit_softcapping=0.0)
    w_ref, sel_ref = route(router, logits.float(), dtype)
    w, sel = fused_route(logits, router.e_score_correction_bias, k, dtype)
    out.append([bool(torch.equal(sel, sel_ref)), ((w.float() - w_ref.float()).abs().max()).item(), str(w.dtype)])
    if tokens == 1 or E == 12 or k == E:  # one token's router inside the routed gate/up launch, against route + the GEMVs
        ex = SimpleNamespace(gate_up_proj=torch.randn(E, 16, 24, generator=g).to(dtype),
                             down_proj=torch.randn(E, 24, 8, generator=g).to(dtype), act_fn=torch.nn.functional.silu)
        x = torch.randn(1, 24, generator=g).to(dtype)
        got, sel1 = routed_one_token(ex, x, logits[:1], router.e_score_correction_bias, k)
        w1, s1 = route(router, logits[:1].float(), dtype)
        want = one_token_experts(ex, x, s1, w1)
        out.append([bool(torch.equal(sel1, s1)), ((got - want).abs().max() / want.abs().max()).item(),
                    "routed " + str(dtype)])
from dflash_lab.spec_decode.fast.triton_ops import act_mul
gu = torch.randn(5, 2 * 40 + 3, generator=g)[:, 3:]  # rows strided, as the shared expert's slice is
ref = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
out.append([True, ((act_mul(torch.nn.SiLU(), gu) - ref).abs().max() / ref.abs().max()).item(), "silu_mul"])
from dflash_lab.spec_decode.fast.triton_ops import write_kv
qkv = torch.randn(2, 3, 4 * 16 + 2 * 2 * 16, generator=g)  # q | k | v of a projection: strided slices
k, v = qkv[..., 64:96].view(2, 3, 2, 16), qkv[..., 96:].view(2, 3, 2, 16)
pos = torch.tensor([[4, 5, 6], [9, 10, 11]])
ck, cv = torch.zeros(2, 2, 12, 16), torch.zeros(2, 2, 12, 16)
write_kv(ck, cv, k, v, pos)
rk, rv = torch.zeros_like(ck), torch.zeros_like(cv)
for b in range(2):
    for j in range(3):
        rk[b, :, pos[b, j]], rv[b, :, pos[b, j]] = k[b, j], v[b, j]
out.append([bool(torch.equal(ck, rk) and torch.equal(cv, rv)), 0.0, "write_kv"])
rows = torch.tensor([3, 1])  # a prefill of two rows of a 4-row cache: rows 0 and 2 untouched
ck, cv = torch.zeros(4, 2, 12, 16), torch.zeros(4, 2, 12, 16)
write_kv(ck, cv, k, v, pos, rows=rows)
rk, rv = torch.zeros_like(ck), torch.zeros_like(cv)
for b in range(2):
    for j in range(3):
        rk[rows[b], :, pos[b, j]], rv[rows[b], :, pos[b, j]] = k[b, j], v[b, j]
out.append([bool(torch.equal(ck, rk) and torch.equal(cv, rv)), 0.0, "write_kv rows"])
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_router_kernel_picks_the_experts_route_picks(interpreted):
    """Laguna's router in one kernel, in Triton's interpreter: the same experts in the same order as
    ``static_target.route`` (XS.2's 256 experts top-8 in bf16, a non-power-of-two count, k = 1, k = E), and
    the same renormalised weights, in the model's dtype; the MLPs' SiLU-and-multiply kernel; and the K/V write
    into cache slots from strided projection slices. One token's router inside the routed gate/up launch
    (``routed_one_token``) picks route's experts and gives the routed output of route's choice and weights."""
    rows = interpreted(ROUTER_SCRIPT)
    assert len(rows) == 10 and [r[2] for r in rows[-3:]] == ["silu_mul", "write_kv", "write_kv rows"]
    assert [r[2] for r in rows if r[2].startswith("routed")] == [
        "routed torch.bfloat16", "routed torch.float32", "routed torch.float32"], rows  # E = 256, 12, k = E
    for same, err, dtype in rows:
        assert same and err < (1e-2 if "bfloat16" in dtype else 1e-6), rows


def test_write_kv_into_some_rows_off_the_kernel():
    """The torch route of ``write_kv(rows=...)`` (no Triton): a prefill's K/V land in its rows' slots only."""
    from dflash_lab.spec_decode.fast.triton_ops import write_kv

    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
    pos, rows = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([2, 0])
    ck, cv = torch.zeros(3, 2, 8, 16), torch.zeros(3, 2, 8, 16)
    write_kv(ck, cv, k, v, pos, rows=rows)
    assert torch.equal(ck[2, :, :3], k[0].transpose(0, 1)) and torch.equal(cv[0, :, :3], v[1].transpose(0, 1))
    assert not ck[1].any() and not cv[:, :, 3:].any()


TAIL_SCRIPT = r"""
import json
import os
import torch
from dflash_lab.layers import TorchOps
from dflash_lab.spec_decode.fast import residual, triton_ops
from transformers.models.laguna.modeling_laguna import LagunaRMSNorm


def rms(width, dtype):
    norm = LagunaRMSNorm(width, eps=1e-6).to(dtype)
    norm.weight.data.copy_(torch.randn(width, generator=g))
    return norm.to(dev)


def randn(*shape, dtype):
    return torch.randn(*shape, generator=g).to(dev, dtype)


def rel(a, b):  # relative to the largest value (the tails add values that may cancel)
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


dev = os.environ.get("TAIL_DEVICE", "cpu")
out = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).split(".")[-1]
    norm = rms(40, dtype)
    h = randn(2, 3, 40, dtype=dtype)
    delta = randn(2, 3, 40 + 5, dtype=dtype)[..., 5:]  # strided rows, as a GEMM slice
    ref_h = h + delta
    ref_x = TorchOps.norm(norm, ref_h)
    new_h, new_x = residual.add_norm(h, delta, norm)
    out[f"add_norm {name}"] = [((new_h.float() - ref_h.float()).abs() / ref_h.float().abs().clamp(min=1e-3)).max().item(),
                              rel(new_x, ref_x)]
    for k in (1, 8):
        experts = randn(6, k, 40, dtype=dtype)
        shared = randn(2, 3, 40, dtype=dtype)
        ref_h = h + (experts.sum(dim=1).view(2, 3, 40) * 2.5 + shared)
        new_h, new_x = residual.experts_add_norm(h, experts, 2.5, shared, norm)
        ref_x = TorchOps.norm(norm, ref_h)
        out[f"experts k={k} {name}"] = [rel(new_h, ref_h), rel(new_x, ref_x)]
    # q/k head norms with partial RoPE, k and v straight into cache slots (B 2, Q 3, 4 q heads, 2 kv heads)
    hd, rot = 16, 12
    qkvg = randn(2, 3, 4 * hd + 2 * 2 * hd + 4, dtype=dtype)  # q | k | v | gate
    qn, kn = rms(hd, dtype), rms(hd, dtype)
    cos, sin = randn(2, 3, rot, dtype=dtype), randn(2, 3, rot, dtype=dtype)
    slots = torch.tensor([[4, 5, 6], [9, 2, 11]], device=dev)
    caches = [torch.zeros(2, 2, 12, hd, dtype=dtype, device=dev) for _ in range(4)]
    q = triton_ops.qk_rope_write(qkvg, qn, kn, cos, sin, slots, caches[0], caches[1], 4, 2, hd)
    rq = TorchOps.norm_rope(qn, qkvg[..., :4 * hd], cos, sin, 4, hd)
    rk = TorchOps.norm_rope(kn, qkvg[..., 4 * hd:6 * hd], cos, sin, 2, hd)
    rv = qkvg[..., 6 * hd:8 * hd].reshape(2, 3, 2, hd)
    for b in range(2):
        for j in range(3):
            caches[2][b, :, slots[b, j]], caches[3][b, :, slots[b, j]] = rk[b, j], rv[b, j]
    out[f"qk_rope_write {name}"] = [rel(q, rq), rel(caches[0], caches[2]),
                                    bool(torch.equal(caches[1], caches[3]))]
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_a_layers_tails_in_one_kernel_each_match_torchs_sequence(interpreted):
    """The residual add + RMSNorm kernel (the add exact), the sparse tail (sum of k expert outputs, the routed
    scale, the shared expert, the add, the norm) and q/k head norms + partial RoPE with k and v written to
    their cache slots, each against the torch ops they replace, in float32 and bfloat16."""
    rows = interpreted(TAIL_SCRIPT)
    assert len(rows) == 8, rows
    for name, vals in rows.items():
        tol = 3e-2 if "bfloat16" in name else 2e-6  # bf16: a few rounding steps (the interpreter truncates)
        if name.startswith("add_norm"):  # the add exact in float32; in bf16 one rounding step (the interpreter
            # rounds float32 -> bf16 toward zero, the GPU to nearest even: equality is checked on the GPU)
            assert vals[0] <= (2 ** -7 if "bfloat16" in name else 0.0) and vals[1] < tol, (name, vals)
        elif name.startswith("experts"):
            assert max(vals) < tol, (name, vals)
        else:
            assert vals[2] and max(vals[:2]) < tol, (name, vals)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_layers_tails_compiled():
    """The same tails compiled: the GPU rounds float32 -> bf16 to nearest even as torch does, so the residual
    add is exact in bfloat16 too."""
    import json
    import subprocess
    import sys
    env = dict(__import__("os").environ, TAIL_DEVICE="cuda", DFLASH_LAB_FUSED="1")
    proc = subprocess.run([sys.executable, "-c", TAIL_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 8 and rows["add_norm bfloat16"][0] == 0.0, rows
    for name, vals in rows.items():
        assert max(v for v in vals if not isinstance(v, bool)) < (2e-2 if "bfloat16" in name else 2e-5), (name, vals)


ALIGN_SCRIPT = r"""
import json
import torch
from dflash_lab.spec_decode.fast.moe import align, align_rows
out = []
for N, k, E, pool, seed in [(2, 2, 8, 8, 0), (16, 2, 8, 8, 1), (16, 8, 256, 256, 2), (40, 3, 12, 5, 3),
                            (300, 8, 256, 40, 4), (5, 1, 3, 3, 5)]:
    g = torch.Generator().manual_seed(seed)
    sel = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(N)])
    rp, be, used = align(sel, E)
    rp2, be2, used2, rows, tok = align_rows(sel, E)
    out.append([torch.equal(rp, rp2), torch.equal(be, be2), torch.equal(used, used2),
                torch.equal(tok, torch.where(rp < N * k, rp // k, 0)), torch.equal(rows, torch.arange(rp.numel()))])
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_one_kernel_layout_is_aligns(interpreted):
    """``align_rows`` (one program, pairs taken a chunk at a time) gives ``align``'s stable layout exactly: rows,
    block experts and the used count, from 4 pairs to 2400 (XS.2's 256 experts top-8 over 300 tokens, 40 of
    them used), and every row's token (0 on padding)."""
    rows = interpreted(ALIGN_SCRIPT)
    assert len(rows) == 6 and all(all(r) for r in rows), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_compiled_kernels_match_the_reference_in_bfloat16():
    """Compiled for the GPU, in bf16 at a sparse layer's proportions: the one-token GEMV (with SiLU fused, and
    with another activation) and the block GEMM (several tokens) against the batched-matmul reference."""
    dev = torch.device("cuda")
    for tokens, act in [(1, "silu"), (1, "gelu"), (5, "silu")]:
        ex = experts(n_experts=64, hidden=512, width=128, seed=tokens)
        ex = SimpleNamespace(gate_up_proj=ex.gate_up_proj.to(dev, torch.bfloat16) * .05,
                             down_proj=ex.down_proj.to(dev, torch.bfloat16) * .05,
                             act_fn=getattr(torch.nn.functional, act))
        selected, weights = routing(tokens, 8, 64, seed=tokens)
        x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(9)).to(dev, torch.bfloat16)
        out = gathered_experts(ex, x, selected.to(dev), weights.to(dev, torch.bfloat16), kernel=True).float()
        ref = gathered_experts(ex, x, selected.to(dev), weights.to(dev, torch.bfloat16), kernel=False).float()
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2, (tokens, act)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_shared_expert_in_the_routed_launch_compiled_in_bfloat16():
    """The one-token path's last row, the shared expert's down projection reading silu(gate) * up from its
    gate/up row (XS.2's widths: hidden 2048, expert and shared width 512), against torch in bf16."""
    from dflash_lab.spec_decode.fast.moe import one_token_experts

    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16, generator=g)
    ex = SimpleNamespace(gate_up_proj=torch.randn(32, 1024, 2048, **bf) * .02,
                         down_proj=torch.randn(32, 2048, 512, **bf) * .02, act_fn=torch.nn.functional.silu)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16, generator=g)
    gu = torch.randn(1, 256 + 1024, device=dev, dtype=torch.bfloat16, generator=g)  # router | shared gate | up
    w_down = torch.randn(2048, 512, device=dev, dtype=torch.bfloat16, generator=g) * .02
    selected = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:8].view(1, 8).to(dev)
    weights = torch.rand(1, 8, device=dev, generator=g).to(torch.bfloat16)
    out = one_token_experts(ex, x, selected, weights, shared=(gu[0, 256:], w_down)).float()
    routed = gathered_experts(ex, x, selected, weights, kernel=False, reduce=False)[0].float()
    shared = torch.nn.functional.linear(torch.nn.functional.silu(gu[:, 256:768]) * gu[:, 768:], w_down).float()
    for got, want in ((out[:8], routed), (out[8:], shared)):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    # the router inside the gate/up launch (256 experts, top 8 of 32 here: biased toward the first 32)
    from dflash_lab.spec_decode.fast.moe import fused_route, routed_one_token

    logits = torch.randn(1, 256 + 9, device=dev, dtype=torch.bfloat16, generator=g)[:, 9:]
    bias = torch.cat([torch.zeros(32, device=dev), torch.full((224,), -9.0, device=dev)])
    got, sel = routed_one_token(ex, x, logits, bias, 8, shared=(gu[0, 256:], w_down))
    w_ref, sel_ref = fused_route(logits, bias, 8, torch.bfloat16)
    want = one_token_experts(ex, x, sel_ref, w_ref, shared=(gu[0, 256:], w_down))
    assert torch.equal(sel, sel_ref)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("switch", ["IN_PRODUCER", "IN_CONSUMER"])
def test_gpu_tails_in_their_producers_replay_the_same_bits_in_a_graph(switch):
    """``residual.IN_PRODUCER`` compiled, bf16, XS.2's widths at 3 layers: one-token steps replayed from CUDA
    graphs (the last-program count must be back at 0 after every launch, or the next replay's tail never runs)
    give the tail kernels' bits, and the counter ends at 0. ``residual.IN_CONSUMER`` likewise, to rounding: its
    norm's sum of squares is reduced by the GEMV's warps, not the tail kernel's, so the last bit of a row's
    scale may differ; the greedy tokens may not."""
    from transformers import LagunaForCausalLM

    from dflash_lab.measure.timing import graphed_ms
    from dflash_lab.presets import laguna_xs_2_config
    from dflash_lab.spec_decode.fast import pdl, residual
    from dflash_lab.spec_decode.fast.static_target import StaticTarget

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LagunaForCausalLM(laguna_xs_2_config(num_hidden_layers=3, num_experts=32, vocab_size=1024)).to(
        dev, torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, 40), device=dev)
    pos = torch.arange(40, device=dev)[None]
    got, was = {}, getattr(residual, switch)
    with torch.no_grad():
        for on in (False, True):
            setattr(residual, switch, on)
            try:
                st = StaticTarget(model, batch=1, capacity=64, layer_ids=[0, 2])
                st.forward(ids[:, :32], pos[:, :32])
                step = lambda: st.forward(ids[:, 32:33], pos[:, 32:33])  # noqa: E731
                graphed_ms(step, dev, reps=5)  # captured and replayed: the counter must survive replays
                got[on] = [t.clone() for t in step()]
            finally:
                setattr(residual, switch, was)
    if switch == "IN_PRODUCER":
        assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
        assert int(pdl._COUNTERS[(ids.device, "residual tail")].abs().sum()) == 0
        return
    assert torch.equal(got[False][0].argmax(-1), got[True][0].argmax(-1))
    for a, b in zip(got[False], got[True]):
        assert (a.float() - b.float()).abs().max() <= 0.02 * a.float().abs().max(), (a - b).abs().max()
