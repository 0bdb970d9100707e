"""The target's forward over a preallocated KV cache, with no host copies or syncs.

``speculative_generate`` runs transformers' ``LagunaForCausalLM`` with a growing
``DynamicCache``: every call builds masks and cache bookkeeping on the host, so a
CUDA graph cannot capture it (capture fails on a host-to-device copy). This is
the same computation, written so that it can be captured and replayed:

    KV cache     one (batch, nkv, S, hd) tensor per layer, allocated once; a forward
                 writes its tokens' K/V at slot == position (``triton_ops.write_kv``), so a
                 rejected draft needs no crop: its slots are overwritten by the
                 next block before any query can see them (queries see slots <= own
                 position, and every such slot was written by an accepted token or
                 by this block)
    attention    on CUDA one kernel a layer (``attention.gated_attention``): which slots a
                 query sees computed from its position (causal, the sliding window, a
                 tree's ancestors), only those slots read, the softplus gate applied.
                 Elsewhere (or ``fused_attention=False``) masks from the positions tensor
                 on the device, cuDNN's or torch's SDPA over every slot, then the gate
    MoE          "auto": on CUDA in bf16/fp16, only the chosen experts' weights are read
                 (``moe.gathered_experts``: pairs sorted by expert into blocks, one Triton
                 GEMM per projection), up to ``GROUPED_FROM_PAIRS`` (token, expert) pairs;
                 past that (a long prefill) torch's grouped GEMM where it runs. Elsewhere
                 (float32, CPU) every expert over every token as one batched GEMM, then a
                 gather of the top-k (exact, and cheap at the shipped pair's 8 experts)
    projections  q/k/v/gate in one GEMM and the MLP's gate/up in one GEMM (the
                 weights concatenated once); the router is the model's own math
    kernels      on CUDA each RMSNorm is one kernel and each q/k head norm + RoPE
                 one more (``triton_ops``); elsewhere the model's own modules

Weights are the model's own parameters (read, never copied, except the
concatenations). Shapes are static for a given (batch, tokens), so one CUDA graph
per shape replays it (``cuda_graphs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...layers import additive_mask, gqa_attention, grouped_mask
from . import attention, gemv, residual, triton_ops
from ..tree import DraftTree, tree_visible
from .moe import fused_route, gathered_experts, kernel_runs, one_token_experts, route_runs, routed_one_token

MOE_IMPLEMENTATIONS = ("auto", "gathered", "grouped", "dense")
GROUPED_FROM_PAIRS = 4096  # "auto": more (token, expert) pairs than this (a prefill) go to torch's grouped GEMM


def _grouped_mm():
    """torch's grouped GEMM (2-D input, 3-D weight, int32 group offsets), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_GROUPED_OK: dict = {}


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here (checked once per device and dtype on a tiny problem)."""
    key = (str(device), dtype)
    if key not in _GROUPED_OK:
        gmm = _grouped_mm()
        try:
            a = torch.ones(32, 16, device=device, dtype=dtype)
            w = torch.ones(2, 32, 16, device=device, dtype=dtype).transpose(1, 2)
            out = gmm(a, w, offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
            _GROUPED_OK[key] = bool(gmm is not None and out.shape == (32, 32) and float(out[0, 0]) == 16.0)
        except Exception:  # no kernel for this device/dtype: the dense path runs instead
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


def grouped_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM exists and runs here (bf16 on CUDA)."""
    usable = device.type == "cuda" and dtype == torch.bfloat16 and _grouped_mm() is not None
    return usable and _grouped_mm_runs(device, dtype)


def resolve_moe(moe: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": "gathered" where its kernel runs (bf16/fp16 on CUDA), else "dense" (exact in float32).

    "gathered" hands calls with more than ``GROUPED_FROM_PAIRS`` pairs to "grouped" where that runs.
    """
    if moe not in MOE_IMPLEMENTATIONS:
        raise ValueError(f"moe must be one of {MOE_IMPLEMENTATIONS}, got {moe!r}")
    if moe == "grouped" and _grouped_mm() is None:
        raise RuntimeError("moe='grouped' needs torch.nn.functional.grouped_mm (torch >= 2.10)")
    if moe == "auto":
        return "gathered" if kernel_runs(torch.empty(0, device=device, dtype=dtype)) else "dense"
    return moe


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------
# Per-layer weights, gathered once
# ---------------------------------------------------------------------------


@dataclass
class _Layer:
    attn: object  # the LagunaAttention module (norms, o_proj, sizes)
    w_in: torch.Tensor  # (q + 2 kv + gate, H): q/k/v/g projections in one GEMM
    b_in: torch.Tensor | None
    split: tuple[int, int, int, int]
    window: int | None  # sliding window, None on full-attention layers
    groups: int  # query heads per KV head (Laguna's head count may differ per layer)
    layer_type: str
    input_norm: object
    post_norm: object
    mlp: object
    sparse: bool
    w_gu: torch.Tensor  # dense: (2I, H) gate|up; sparse: (E + 2I_shared, H) router|shared gate|shared up
    w_down: torch.Tensor  # dense MLP or shared expert down projection
    act: object  # the dense MLP's or shared expert's activation


def _prepare_layer(layer, layer_type: str, window: int | None) -> _Layer:
    a = layer.self_attn
    ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.g_proj.weight]
    b_in = None
    if a.q_proj.bias is not None:
        b_in = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.g_proj.weight.new_zeros(ws[3].shape[0])])
    mlp = layer.mlp
    sparse = hasattr(mlp, "experts")
    if sparse:
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert")
        w_gu = torch.cat([mlp.gate.weight, shared.gate_proj.weight, shared.up_proj.weight])
        w_down, act = shared.down_proj.weight, shared.act_fn
    else:
        w_gu, w_down, act = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight, mlp.act_fn
    return _Layer(attn=a, w_in=torch.cat(ws), b_in=b_in, split=tuple(w.shape[0] for w in ws),
                  window=window if layer_type == "sliding_attention" else None, layer_type=layer_type,
                  groups=ws[0].shape[0] // ws[1].shape[0],
                  input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm, mlp=mlp,
                  sparse=sparse, w_gu=w_gu, w_down=w_down, act=act)


def _rope_tables(target, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of every slot's position, per layer type, made once: a step reads its rows instead of
    computing RoPE again (about 7 kernels per layer type and step). The values are the rotary module's own at
    those positions, elementwise. None for RoPE types whose frequencies depend on the sequence length."""
    rotary = target.model.rotary_emb
    if any(t in ("dynamic", "longrope") for t in getattr(rotary, "rope_type", {}).values()):
        return None
    probe = torch.empty(0, device=positions.device, dtype=dtype)
    with torch.no_grad():
        return {t: tuple(c[0] for c in rotary(probe, positions[None], t)) for t in set(target.config.layer_types)}


# ---------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------


class StaticTarget:
    """A ``LagunaForCausalLM`` forward over a preallocated KV cache for ``batch`` sequences of up to ``capacity`` slots.

    ``forward(ids, positions)`` reads tokens ids (B, Q) at positions (B, Q) (any
    per-sequence offsets), writes their K/V at those slots, and returns the logits
    and the outputs of ``layer_ids`` (the drafter's aux hidden states).
    """

    def __init__(self, target, *, batch: int, capacity: int, layer_ids=(), moe: str = "auto",
                 fused_attention: bool = True):
        cfg = target.config
        self.fused_attention = fused_attention  # attention.gated_attention where it runs (CUDA), else masks + SDPA
        p = next(target.parameters())
        self.model, self.config, self.device, self.dtype = target, cfg, p.device, p.dtype
        self.batch, self.capacity = batch, round_up(capacity, 16)  # fused attention kernels like 16-aligned masks
        self.layer_ids = list(layer_ids)
        self.moe = resolve_moe(moe, self.device, self.dtype)
        self._grouped_ok = self.moe == "gathered" and grouped_usable(self.device, self.dtype)
        self.routing = None  # set to a list to record each sparse layer's expert choices (eager calls)
        self.layer_types = list(cfg.layer_types)
        self.layers = [_prepare_layer(layer, t, cfg.sliding_window)
                       for layer, t in zip(target.model.layers, self.layer_types)]
        nkv, hd = cfg.num_key_value_heads, self.layers[0].attn.head_dim
        shape = (batch, nkv, self.capacity, hd)
        # one buffer (L, 2, ...) viewed per layer: a tree's accepted path moves in one gather and one scatter
        self.kv = torch.zeros((len(self.layers), 2, *shape), device=self.device, dtype=self.dtype)
        self.cache = [(self.kv[i, 0], self.kv[i, 1]) for i in range(len(self.layers))]
        self.slots = torch.arange(self.capacity, device=self.device)
        self.rope_tables = _rope_tables(target, self.slots, self.dtype)  # {layer type: (cos, sin) (S, rd)} or None

    # --- pieces ----------------------------------------------------------------
    def _bias(self, positions: torch.Tensor, window: int | None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """(B, Q, S) additive mask: slot <= position, and within the window on sliding layers."""
        pos = positions[:, :, None]
        slots = self.slots if slots is None else slots
        visible = slots <= pos
        if window is not None:
            visible &= slots > pos - window
        return additive_mask(visible, self.dtype)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at slots src (B, M) copied to slots dst (B, M) (all read before any is written):
        a verified tree's accepted path moved to the slots its positions own."""
        L, two, B, nkv, _, hd = self.kv.shape
        moved = self.kv.gather(4, src[None, None, :, None, :, None].expand(L, two, B, nkv, -1, hd))
        self.kv.scatter_(4, dst[None, None, :, None, :, None].expand(L, two, B, nkv, -1, hd), moved)

    def _attention(self, lay: _Layer, i: int, x: torch.Tensor, cos, sin, positions, bias, rows=None,
                   fused=None, rope_positions=None) -> torch.Tensor:
        """The layer's gated attention output, before o_proj (which the forward runs with the residual tail)."""
        a = lay.attn
        B, Q, _ = x.shape
        qkvg = gemv.linear(x, lay.w_in, lay.b_in)
        heads, nkv = lay.split[0] // a.head_dim, lay.split[1] // a.head_dim
        g = qkvg[..., sum(lay.split[:3]):]
        cache_k, cache_v = self.cache[i]
        if rows is None and fused is not None and fused[1] is None and attention.rope_in_usable(qkvg):
            eps = triton_ops.norm_eps(a.q_norm)  # a chain step: norms, RoPE and the K/V write in the attention
            if eps == triton_ops.norm_eps(a.k_norm):  # a chain step's RoPE positions are its query positions,
                rpos = None if rope_positions is None else fused[0]  # already int32: no conversion a layer
                return attention.rope_attention(qkvg, a.q_norm.weight, a.k_norm.weight, eps, cos, sin, rpos,
                                                cache_k, cache_v, g, fused[0], a.scaling, heads, window=lay.window,
                                                per_head=a.gate_per_head)
        if rows is None:  # q (B, Q, H, hd); k and v written to their slots (one kernel where Triton runs)
            q = triton_ops.qk_rope_write(qkvg, a.q_norm, a.k_norm, cos, sin, positions, cache_k, cache_v,
                                         heads, nkv, a.head_dim, rope_positions)
        else:  # a prefill of some rows from position 0: it sees only its own keys, then they go to the rows' slots
            q, k, v = qkvg[..., :sum(lay.split[:3])].split(lay.split[:3], dim=-1)
            q = triton_ops.norm_rope(a.q_norm, q, cos, sin, heads, a.head_dim)  # (B, Q, H, hd)
            k = triton_ops.norm_rope(a.k_norm, k, cos, sin, nkv, a.head_dim)  # (B, Q, nkv, hd)
            v = v.view(B, Q, -1, a.head_dim)
            triton_ops.write_kv(*self.cache[i], k, v, positions, rows=rows)  # into the rows' slots, one kernel
            cache_k, cache_v = k.transpose(1, 2), v.transpose(1, 2)  # (B, nkv, Q, hd): what the prefill attends to
        if fused is not None:  # (query positions, tree start, ancestors): one kernel, gate included
            qpos, start, ancestors = fused
            return attention.gated_attention(q, cache_k, cache_v, g, qpos, a.scaling, window=lay.window,
                                             per_head=a.gate_per_head, tree_start=start, ancestors=ancestors)
        out = gqa_attention(q, cache_k, cache_v, bias, a.scaling)  # (B, Q, H*hd)
        gate = F.softplus(g.float()).to(out.dtype)
        if a.gate_per_head:
            return (out.view(B, Q, -1, a.head_dim) * gate.unsqueeze(-1)).view(B, Q, -1)
        return out * gate

    def _mlp_add_norm(self, lay: _Layer, x: torch.Tensor | None, h: torch.Tensor, norm,
                      pending: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of the normed x added to the residual h: (h', norm(h')), the MLP's tail in one kernel
        (``residual``) where Triton runs. pending = (delta, post_norm): x is norm(h + delta), h's add not yet
        made; the MLP's first product computes both (``gemv.add_norm_linear``, ``residual.IN_CONSUMER``)."""
        g = None
        if pending is not None:
            h, x, g = gemv.add_norm_linear(h, pending[0], pending[1], lay.w_gu)
        B, Q, H = x.shape
        x = x.reshape(B * Q, H)
        g = gemv.linear(x, lay.w_gu) if g is None else g.reshape(B * Q, -1)  # dense: gate | up
        if not lay.sparse:
            return gemv.linear_add_norm(triton_ops.act_mul(lay.act, g), lay.w_down, h, norm)
        mlp, router = lay.mlp, lay.mlp.gate
        n_exp = router.weight.shape[0]  # g: router | shared gate | up
        logits = g[:, :n_exp]
        # one token: the router runs inside the routed gate/up launch, and the shared expert's down projection
        # rides in the routed down launch (two launches for router, routed and shared experts)
        one = B * Q == 1 and self.moe == "gathered" and kernel_runs(x) and triton_ops.is_silu(lay.act)
        fused = route_runs(logits, router)  # the router in Triton (float32 inside), not torch's ops
        if one:  # and the layer's residual tail after them (inside the down launch where ``residual`` allows)
            both, tail = (g[0, n_exp:], lay.w_down), (h, mlp.routed_scaling_factor, norm)
            if fused:
                h_x, selected = routed_one_token(mlp.experts, x, logits, router.e_score_correction_bias,
                                                 router.top_k, shared=both, tail=tail)
            else:
                weights, selected = route(router, logits.float(), x.dtype)
                h_x = one_token_experts(mlp.experts, x, selected, weights, shared=both, tail=tail)
            if self.routing is not None:
                self.routing.append(selected)
            return h_x
        else:
            shared = gemv.linear(triton_ops.act_mul(lay.act, g[:, n_exp:]), lay.w_down)
            if fused:
                weights, selected = fused_route(logits, router.e_score_correction_bias, router.top_k, x.dtype)
            else:
                weights, selected = route(router, logits.float(), x.dtype)  # (N, k) each
            routed = self._experts(mlp.experts, x, selected, weights)  # (N, k, H), or (N, H) already summed
        if routed.dim() == 2:
            routed = routed[:, None]
        return residual.experts_add_norm(h, routed, mlp.routed_scaling_factor, shared.view(B, Q, H), norm)

    def _experts(self, experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.routing is not None:  # eager diagnostics only (a list of each sparse layer's choices)
            self.routing.append(selected)
        moe = self.moe
        if moe == "gathered" and selected.numel() > GROUPED_FROM_PAIRS and self._grouped_ok:
            moe = "grouped"  # chosen by token count: a long prefill is compute-bound, grouped GEMM tiles pay there
        if moe == "gathered":  # the k outputs of each token unsummed: the layer's tail kernel sums them
            return gathered_experts(experts, x, selected, weights, reduce=False)
        if moe == "grouped":
            return grouped_experts(experts, x, selected, weights)
        return dense_experts(experts, x, selected, weights)

    # --- the forward -------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, *, last_index: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, tree: DraftTree | None = None, start: torch.Tensor | None = None):
        """ids, positions (B, Q) -> (logits, aux).

        logits: (B, Q, V), or (B, V) at ``last_index`` (B,) when given (a prefill
        needs only each sequence's last prompt position). aux: (B, Q, n * H) outputs
        of ``layer_ids`` (raw residual stream, as ``target_forward`` captures them),
        or None without layer_ids. ``rows`` (n,): a prefill of n sequences from position 0 (positions
        (n, Q) = 0 .. Q-1) into those cache rows, the other rows untouched; its cost is n rows', not the
        batch's (a row listed twice must hold the same prompt twice). ``tree`` (a ``DraftTree``, ids
        [x_t, its nodes]) with ``start`` (B,) the root's position: positions are start + depth, K/V go to
        slots start .. start+N, and each node attends to the context and its ancestors (``tree_visible``).
        """
        m = self.model.model
        h = m.embed_tokens(ids)
        rope_pos = positions if self.rope_tables is not None and rows is None else None
        if rope_pos is not None:  # tables (S, rd), read at the positions inside the kernels
            rope = self.rope_tables
        elif self.rope_tables is not None:  # a prefill from position 0: the tables' first Q rows (a view at n = 1)
            rope = {t: tuple(c[:ids.shape[1]].expand(ids.shape[0], -1, -1) for c in cs)
                    for t, cs in self.rope_tables.items()}
        else:  # (B, Q, rd)
            rope = {t: m.rotary_emb(h, positions, t) for t in set(self.layer_types)}
        slots = None if rows is None else self.slots[:ids.shape[1]]
        windows = {lay.window for lay in self.layers}
        write_at = positions if tree is None else start[:, None] + self.slots[:ids.shape[1]]
        fused, bias = None, {}
        if self.fused_attention and attention.usable(h):  # visibility computed in the kernel: no masks
            fused = (positions.int(), None, None) if tree is None else \
                ((start[:, None] + tree.depths_with_root()).int(), start.int(), tree.ancestors)  # int32 once
        else:
            if tree is None:
                masks = {w: self._bias(positions, w, slots) for w in windows}
            else:
                masks = {w: additive_mask(v, self.dtype)
                         for w, v in tree_visible(tree, start, self.slots, windows).items()}
            bias = {(lay.window, lay.groups): grouped_mask(masks[lay.window], lay.groups, *ids.shape)
                    for lay in self.layers}  # once per forward for every layer; per-layer head counts differ
        captured = {}
        x = triton_ops.norm(self.layers[0].input_norm, h)
        norms = [lay.input_norm for lay in self.layers[1:]] + [m.norm]  # the norm after each layer's MLP
        for i, lay in enumerate(self.layers):  # each add and the norm after it are one kernel (``residual``)
            cos, sin = rope[lay.layer_type]
            a = self._attention(lay, i, x, cos, sin, write_at, bias.get((lay.window, lay.groups)), rows, fused,
                                rope_pos)
            if residual.IN_CONSUMER and h.numel() == h.shape[-1]:  # one row: the add's norm inside the MLP's product
                d = gemv.linear(a, lay.attn.o_proj.weight, lay.attn.o_proj.bias).view(h.shape)
                h, x = self._mlp_add_norm(lay, None, h, norms[i], pending=(d, lay.post_norm))
            else:
                h, x = gemv.linear_add_norm(a, lay.attn.o_proj.weight, h, lay.post_norm, lay.attn.o_proj.bias)
                h, x = self._mlp_add_norm(lay, x, h, norms[i])
            if i in self.layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None  # (B, Q, n*H)
        if last_index is not None:  # the norm is per row: gathering after it picks the same rows
            x = x.gather(1, last_index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]  # (B, H)
        return self.model.lm_head(x), aux


# ---------------------------------------------------------------------------
# Router and experts
# ---------------------------------------------------------------------------


def route(router, logits: torch.Tensor, dtype: torch.dtype):
    """Laguna's router on float32 logits (N, E): sigmoid scores, top-k by score + correction bias,
    weights renormalised over the chosen k -> (weights (N, k) in dtype, expert ids (N, k))."""
    cap = getattr(router, "router_logit_softcapping", 0.0) or 0.0
    if cap > 0:
        logits = torch.tanh(logits / cap) * cap
    scores = torch.sigmoid(logits)
    _, selected = torch.topk(scores + router.e_score_correction_bias.to(scores.dtype), router.top_k, dim=-1)
    weights = scores.gather(-1, selected)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(dtype), selected


def _gate_up_act(experts, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def grouped_experts(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts as two grouped GEMMs: (token, expert) pairs sorted by expert, one group per expert.

    Group sizes come from a scatter-add on the device (no bincount, which syncs);
    experts with no tokens cost nothing. x (N, H) -> (N, H).
    """
    N, k = selected.shape
    gmm = _grouped_mm()
    flat = selected.reshape(-1)  # (N*k,)
    order = torch.argsort(flat)
    counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]  # (N*k, H) grouped by expert
    h = gmm(xs, experts.gate_up_proj.transpose(1, 2), offs=offsets)  # (N*k, 2I)
    out = gmm(_gate_up_act(experts, h), experts.down_proj.transpose(1, 2), offs=offsets)  # (N*k, H)
    out = out * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, slot) order
    return unsorted.view(N, k, -1).sum(dim=1)


def dense_experts(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every expert over every token in one batched GEMM per projection, then the chosen k of them.

    E/k times the arithmetic of the routed computation and no sort: right for a few
    small experts (the shipped pair: 8 of width 128), wrong for Laguna-XS.2's 256.
    """
    E = experts.gate_up_proj.shape[0]
    h = torch.bmm(x.unsqueeze(0).expand(E, -1, -1), experts.gate_up_proj.transpose(1, 2))  # (E, N, 2I)
    out = torch.bmm(_gate_up_act(experts, h), experts.down_proj.transpose(1, 2))  # (E, N, H)
    picked = out.transpose(0, 1).gather(1, selected[..., None].expand(-1, -1, out.shape[-1]))  # (N, k, H)
    return (picked * weights[..., None]).sum(dim=1)
