"""The static path's attention kernel (``spec_decode.fast.attention``) against the torch route it replaces.

The kernel source runs in Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, as in
test_kernels.py): every visibility rule (causal, sliding window, a prefill's own keys, a draft tree with
its window on positions), grouped heads, both gate layouts, head sizes that are not powers of two, in float32
(bfloat16 on the GPU only: the interpreter's bfloat16 tl.dot is wrong); then a whole ``StaticTarget``
at Laguna-XS.2's layer pattern with the kernel on and off.
On a GPU the compiled kernel is checked the same way (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

CASES = r"""
import torch
import torch.nn.functional as F
from dflash_lab.layers import additive_mask, gqa_attention
from dflash_lab.spec_decode.fast.attention import gated_attention
from dflash_lab.spec_decode.tree import build_draft_tree, tree_visible


def torch_route(q, k, v, gate, qpos, scale, window, per_head, tree=None, start=None):
    B, Q, H, hd = q.shape
    slots = torch.arange(k.shape[2], device=q.device)
    if tree is None:
        visible = slots <= qpos[:, :, None]
        if window is not None:
            visible &= slots > qpos[:, :, None] - window
    else:
        visible = tree_visible(tree, start, slots, [window])[window]
    out = gqa_attention(q, k, v, additive_mask(visible, q.dtype), scale)
    g = F.softplus(gate.float()).to(out.dtype)
    return (out.view(B, Q, H, hd) * g[..., None]).view(B, Q, -1) if per_head else out * g


def case(name, B, Q, H, nkv, hd, S, qpos, window, per_head, dtype, tree=None, start=None, prefill=False, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)
    q = r(B, Q, H, hd)
    if prefill:  # a prefill's own keys: (B, Q, nkv, hd) viewed as (B, nkv, Q, hd), not contiguous
        k, v = r(B, Q, nkv, hd).transpose(1, 2), r(B, Q, nkv, hd).transpose(1, 2)
    else:
        k, v = r(B, nkv, S, hd), r(B, nkv, S, hd)
    gate = r(B, Q, H if per_head else H * hd) * 3
    qpos = qpos.to(DEVICE)
    ref = torch_route(q, k, v, gate, qpos, hd ** -0.5, window, per_head, tree, start)
    out = gated_attention(q, k, v, gate, qpos, hd ** -0.5, window=window, per_head=per_head,
                          tree_start=start, ancestors=None if tree is None else tree.ancestors)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return name, err


def run_cases(with_bf16=True):
    f32, bf16 = torch.float32, torch.bfloat16
    ar = lambda n: torch.arange(n)
    tree_logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    tree = build_draft_tree(tree_logits, 12)
    start = torch.tensor([20, 50], device=DEVICE)
    tree_pos = start[:, None] + tree.depths_with_root()
    out = [
        case("decode", 3, 1, 4, 2, 64, 80, torch.tensor([[5], [40], [79]]), None, True, f32),
        case("decode window", 3, 1, 4, 2, 64, 80, torch.tensor([[5], [40], [79]]), 16, True, f32),
        case("block ragged window, 6 groups, hd 48, gate per channel", 2, 16, 12, 2, 48, 96,
             torch.stack([10 + ar(16), 70 + ar(16)]), 24, False, f32),
        case("prefill own keys, window", 2, 40, 4, 2, 64, 40, torch.stack([ar(40), ar(40)]), 8, True, f32,
             prefill=True),
        case("tree", 2, 13, 4, 2, 64, 96, tree_pos, None, True, f32, tree=tree, start=start),
        case("tree, window 3 on positions", 2, 13, 4, 2, 64, 96, tree_pos, 3, True, f32, tree=tree, start=start),
        # a long cache: the slots split among programs (flash-decoding), then merged
        case("decode, long cache split", 3, 1, 4, 2, 64, 600, torch.tensor([[3], [300], [599]]), None, True, f32),
        case("block, long cache split, window 200", 2, 16, 6, 2, 48, 640, torch.stack([300 + ar(16), 600 + ar(16)]),
             200, False, f32),
        case("tree, long cache split", 2, 13, 4, 2, 64, 640, tree_pos + 500, None, True, f32, tree=tree,
             start=start + 500),
    ]
    # the splits above merged by the last of them (one launch); every counter is back at 0 afterwards
    from dflash_lab.spec_decode.fast import attention, pdl
    out.append(("merge counters left at 0", float(sum(c.abs().sum().item() for c in pdl._COUNTERS.values()))))
    attention.MERGE_IN_LAST = False  # the second kernel's merge
    try:
        out.append(case("decode, long cache split, merged by a second kernel", 3, 1, 4, 2, 64, 600,
                        torch.tensor([[3], [300], [599]]), None, True, f32))
    finally:
        attention.MERGE_IN_LAST = True
    if with_bf16:  # Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot): the GPU test only
        out += [case("block bfloat16 window", 2, 16, 8, 1, 128, 64, torch.stack([3 + ar(16), 40 + ar(16)]), 20,
                     True, bf16),
                case("tree bfloat16", 2, 13, 8, 2, 128, 96, tree_pos, 16, True, bf16, tree=tree, start=start)]
    return out
"""

INTERPRETER = CASES + r"""
import json
DEVICE = "cpu"
print(json.dumps(run_cases(with_bf16=False)))
"""

SMALL_XS2 = r"""
import json
import torch
from transformers import LagunaForCausalLM
from dflash_lab.presets import laguna_xs_2_config
from dflash_lab.spec_decode.fast.static_target import StaticTarget

torch.manual_seed(0)
cfg = laguna_xs_2_config(num_hidden_layers=4, vocab_size=64, hidden_size=64, intermediate_size=96, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16, sliding_window=6,
                         num_attention_heads_per_layer=[4, 8, 8, 8])
DEV, DT = globals().get("DEV", "cpu"), globals().get("DT", torch.float32)  # a GPU test sets them
model = LagunaForCausalLM(cfg).eval().to(DEV, DT)
"""  # Laguna-XS.2's layer pattern (dense first layer, 1 full : 3 sliding, per-layer heads), tiny widths

STATIC_TARGET = SMALL_XS2 + r"""
from dflash_lab.spec_decode.tree import build_draft_tree

prompt = torch.randint(0, 64, (2, 24))
out = {}
with torch.no_grad():
    logits = {}
    for fused in (True, False):
        st = StaticTarget(model, batch=2, capacity=64, fused_attention=fused)
        pos = torch.arange(24).expand(2, -1)
        a, _ = st.forward(prompt, pos)
        block = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
        b, _ = st.forward(block, torch.stack([24 + torch.arange(5), 24 + torch.arange(5)]))
        tree = build_draft_tree(torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2)), 9)
        ids = torch.cat([block[:, :1], tree.token_ids], dim=1)
        start = torch.tensor([29, 29])
        c, _ = st.forward(ids, start[:, None] + tree.depths_with_root(), tree=tree, start=start)
        logits[fused] = (a, b, c)
    for name, x, y in zip(("prefill", "block", "tree"), logits[True], logits[False]):
        out[name] = ((x - y).abs().max() / y.abs().max()).item()
    ref = model(prompt).logits  # transformers' own forward: every kernel of the static path at once
    out["prefill against transformers"] = ((logits[True][0] - ref).abs().max() / ref.abs().max()).item()
print(json.dumps(out))
"""

ROPE_IN = SMALL_XS2 + r"""
from dflash_lab.spec_decode.fast import attention, triton_ops

gen = torch.Generator().manual_seed(1)
prompt, block, one = (torch.randint(0, 64, s, generator=gen).to(DEV) for s in ((2, 24), (2, 5), (2, 1)))
calls, was_rope_in = [], attention.ROPE_IN
real = triton_ops.qk_rope_write
triton_ops.qk_rope_write = lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k)
out = {}
with torch.no_grad():
    for capacity in (64, 640):  # 640: the slots split among programs (flash-decoding)
        at = [40, 600] if capacity == 640 else [24, 30]
        for tables in (True, False):
            seen = {}
            for rope_in in (True, False):
                attention.ROPE_IN, calls[:] = rope_in, []
                st = StaticTarget(model, batch=2, capacity=capacity)
                if not tables:  # cos/sin computed per token instead of read from tables
                    st.rope_tables = None
                logits = [st.forward(prompt, torch.arange(24, device=DEV).expand(2, -1))[0]]
                pos = (torch.tensor(at)[:, None] + torch.arange(5)).to(DEV)
                logits.append(st.forward(block, pos)[0])
                logits.append(st.forward(one, pos[:, -1:] + 1)[0])
                seen[rope_in] = (logits, [t.clone() for pair in st.cache for t in pair], list(calls))
            name = f"capacity {capacity}, {'tables' if tables else 'rows'}"
            (l1, c1, k1), (l0, c0, k0) = seen[True], seen[False]
            out[name] = [all(torch.equal(a, b) for a, b in zip(l1, l0)), all(torch.equal(a, b) for a, b in zip(c1, c0)),
                         k1, k0]
attention.ROPE_IN, triton_ops.qk_rope_write = was_rope_in, real
print(json.dumps(out))
"""


STATIC_DRAFTER = r"""
import json
import torch
from dflash_lab.assets import load_default_pair
from dflash_lab.drafter import with_window
from dflash_lab.spec_decode.fast import triton_ops
from dflash_lab.spec_decode.fast.static_drafter import StaticDrafter

target, paper, _ = load_default_pair("cpu", dtype=torch.float32)
poolside = load_default_pair("cpu", dtype=torch.float32, drafter="poolside")[1]
gen = torch.Generator().manual_seed(0)
out = {}
with torch.no_grad():
    for name, drafter in (("paper, non-causal", paper), ("paper, non-causal, window 6", with_window(paper, 6)),
                          ("poolside, causal, window 64", poolside),
                          ("poolside, causal, window 5", with_window(poolside, 5))):
        sd = StaticDrafter(drafter, target, batch=2, capacity=112, block_size=16)
        sd.kv.k.copy_(torch.randn(sd.kv.k.shape, generator=gen))
        sd.kv.v.copy_(torch.randn(sd.kv.v.shape, generator=gen))
        first, start = torch.tensor([5, 77]), torch.tensor([20, 90])
        fused = sd.draft_logits(first, start, 16)
        usable, triton_ops.attention_usable = triton_ops.attention_usable, lambda x: False
        masked = sd.draft_logits(first, start, 16)
        triton_ops.attention_usable = usable
        out[name] = ((fused - masked).abs().max() / masked.abs().max()).item()
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_kernel_sees_what_the_masks_show_in_the_interpreter(interpreted):
    errs = dict(interpreted(INTERPRETER))
    assert len(errs) == 11, errs
    for name, err in errs.items():
        assert err < (2e-2 if "bfloat16" in name else 2e-6), (name, err)


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_a_static_target_with_the_kernel_gives_the_masks_logits(interpreted):
    """Laguna-XS.2's layer pattern (dense first layer, 1 full : 3 sliding, per-layer heads): a prefill, a block
    and a tree, float32, kernel on against kernel off; and the prefill, with every kernel of the static path
    (norms, RoPE, attention, router, SiLU-and-multiply), against transformers' forward."""
    errs = interpreted(STATIC_TARGET)
    assert set(errs) == {"prefill", "block", "tree", "prefill against transformers"}
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_attention_kernel_taking_rope_in_changes_no_value(interpreted):
    """``attention.ROPE_IN``: a chain step's q/k head norms, partial RoPE and K/V write run inside the attention
    kernel, not in a kernel of their own. Logits and every cache slot equal the two-kernel route's bit for bit
    (float32, Laguna-XS.2's pattern with partial RoPE on its full layers; a prompt, a ragged block and a decode
    step; short and split caches; cos/sin from tables and per token), and the separate kernel runs only with the
    switch off."""
    runs = interpreted(ROPE_IN)
    assert len(runs) == 4
    for name, (same_logits, same_cache, calls_on, calls_off) in runs.items():
        assert same_logits and same_cache, name
        assert calls_on == [] and calls_off == [24] * 4 + [5] * 4 + [1] * 4, (name, calls_on, calls_off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_attention_kernel_taking_rope_in_changes_no_value():
    """The same in bfloat16, compiled, under PDL: both routes round every value alike, so bit for bit too."""
    scope = {"DEV": "cuda", "DT": torch.bfloat16}
    exec(ROPE_IN, scope)
    for name, (same_logits, same_cache, calls_on, calls_off) in scope["out"].items():
        assert same_logits and same_cache and calls_on == [] and len(calls_off) == 12, name


def test_bad_shapes_are_refused_before_any_launch():
    from dflash_lab.spec_decode.fast.attention import gated_attention

    q, k = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 8, 16)
    gate, pos = torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit"):
        gated_attention(q, k, torch.zeros(1, 2, 7, 16), gate, pos, 0.25)
    with pytest.raises(ValueError, match="gate"):
        gated_attention(q, k, k, torch.zeros(1, 2, 5), pos, 0.25)
    with pytest.raises(ValueError, match="tree_start"):
        gated_attention(q, k, k, gate, pos, 0.25, tree_start=torch.zeros(1, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_compiled_kernel_sees_what_the_masks_show():
    scope = {}
    exec(CASES, scope)
    scope["DEVICE"] = "cuda"
    errs = scope["run_cases"]()
    assert len(errs) == 13
    for name, err in errs:
        assert err < (2e-2 if "bfloat16" in name else 2e-5), (name, err)


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_drafters_block_through_the_kernel_gives_the_masks_logits(interpreted):
    """Both shipped drafters' blocks over their context slots (``SlotVisibility``): non-causal (the paper's) and
    causal (the Poolside-style), each also under a window narrower than the block, float32, kernel on and off."""
    errs = interpreted(STATIC_DRAFTER)
    assert len(errs) == 4
    assert max(errs.values()) < 1e-5, errs


def test_the_split_count_is_a_function_of_the_cache_alone():
    from dflash_lab.spec_decode.fast.attention import MAX_SPLITS, SPLIT_FROM, num_splits

    assert num_splits(SPLIT_FROM - 1) == 1 and num_splits(SPLIT_FROM) > 1
    assert num_splits(1 << 20) == MAX_SPLITS
