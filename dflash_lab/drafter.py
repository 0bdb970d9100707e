"""The Laguna DFlash drafter, in the order data flows through it.

    target aux hidden states [N, n_aux * H_t]
        -> combine_hidden_states      (per-slice RMSNorm, concat, fc, hidden_norm)   [N, H]
        -> precompute_context_kv      (every layer's K/V of the context, once;
                                       three paths in context_kv.py)                 [L, N, nkv, hd]
    block = [last token, mask x (B-1)], embedded with the TARGET's embedding table   [B, H]
        -> forward                    (L decoder layers; queries = the block, keys/values =
                                       context K/V + block K/V from a K/V store; who sees
                                       whom: visible_keys, vLLM's causality and window)  [B, H]
        -> the target's lm_head       (position j >= 1 predicts the token AT j)

Every backend drafts through this one forward: the eager loop and training keep the
context beside the block (``ConcatKV``), the static/graphed path writes it into
preallocated slots (``SlotKV``) and passes one-kernel norms as ``ops``.

Parameter names match vLLM 0.33's ``DFlashLagunaForCausalLM`` checkpoint layout
(``layers.0.self_attn.qkv_proj.weight``, ``fc.weight``, ...), so a state dict of
this module is a vLLM drafter checkpoint. The drafter owns no embedding and no
lm_head: both are the target's. RMSNorm and RoPE come from ``layers.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashDrafterConfig
from .context_kv import compute_context_kv
from .block_attention import (ConcatKV, SlotKV, SlotLayer, SlotVisibility,  # noqa: F401
                              dflash_attention_mask, draft_block_ids, visible_keys)
from .layers import RMSNorm, TorchOps, apply_rope, gqa_attention, grouped_mask, rope_tables

# ---------------------------------------------------------------------------
# Layers (Laguna-flavoured)
# ---------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Laguna attention: fused qkv, per-head q/k RMSNorm, partial RoPE, softplus gate.

    The one implementation of the drafter's block attention, for every backend: where the
    keys live (beside the block, or in preallocated slots) is the K/V store's business
    (``ConcatKV`` / ``SlotKV`` below), how norms run is ``ops``'s (``layers.TorchOps``, or
    the fast path's one-kernel versions).
    """

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.gating = cfg.gating
        self.gate_per_head = cfg.gate_per_head
        if cfg.gating:
            self.g_proj = nn.Linear(cfg.hidden_size, self.num_heads if self.gate_per_head else self.q_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.stacked: dict | None = None  # the drafter's stacked-weight cache (ops.linears may keep qkv|g there)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V of already-normalised inputs x (..., H)."""
        kv = F.linear(x, self.qkv_proj.weight[self.q_size :],
                      None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :])
        k, v = kv.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(-3)  # (..., nkv, hd) each
        return apply_rope(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, keys_values, mask, ops=TorchOps):
        """x: (B, Q, H) normalised block states; keys_values(k, v) -> all keys/values (B, S, nkv, hd);
        mask: (B, Q, S) bool, True where a query sees a key."""
        qkv, *g = ops.linears(x, [self.qkv_proj, self.g_proj] if self.gating else [self.qkv_proj], self.stacked)
        if isinstance(mask, SlotVisibility) and isinstance(keys_values, SlotLayer) and hasattr(ops, "qk_rope_write"):
            # the fast path: q/k norms and RoPE, the block's K/V into its slots, in one kernel; then the attention
            cache_k, cache_v = keys_values.k.transpose(1, 2), keys_values.v.transpose(1, 2)  # (B, nkv, S, hd)
            at = keys_values.positions
            q = ops.qk_rope_write(qkv, self.q_norm, self.k_norm, cos, sin, at, cache_k, cache_v, self.num_heads,
                                  self.num_kv_heads, self.head_dim, at if cos.dim() == 2 else None)
            return self.o_proj(ops.slot_attention(q, cache_k, cache_v, g[0] if self.gating else None, mask,
                                                  self.head_dim**-0.5, self.gate_per_head))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.norm_rope(self.q_norm, q, cos, sin, self.num_heads, self.head_dim)  # (B, Q, nh, hd)
        k = ops.norm_rope(self.k_norm, k, cos, sin, self.num_kv_heads, self.head_dim)  # (B, Q, nkv, hd)
        keys, values = keys_values(k, v.unflatten(-1, (self.num_kv_heads, self.head_dim)))  # (B, S, nkv, hd)
        if isinstance(mask, SlotVisibility):  # the fast path's kernel: visibility computed, gate applied
            return self.o_proj(ops.slot_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                                  g[0] if self.gating else None, mask, self.head_dim**-0.5,
                                                  self.gate_per_head))
        out = gqa_attention(q, keys.transpose(1, 2), values.transpose(1, 2), mask, self.head_dim**-0.5)  # (B, Q, nh*hd)
        if self.gating:
            gate = F.softplus(g[0].float()).to(out.dtype)
            out = out.unflatten(-1, (self.num_heads, self.head_dim))  # (B, Q, nh, hd)
            out = out * (gate.unsqueeze(-1) if self.gate_per_head else gate.unflatten(-1, out.shape[-2:]))
            out = out.flatten(-2)
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    """Dense SiLU MLP (drafter layers are never MoE)."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.stacked: dict | None = None  # the drafter's stacked-weight cache (ops.linears may keep gate|up there)

    def forward(self, x, ops=TorchOps):
        gate, up = ops.linears(x, [self.gate_proj, self.up_proj], self.stacked)
        return self.down_proj(ops.silu_mul(gate, up))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, h, cos, sin, keys_values, mask, ops=TorchOps, *, x=None, next_norm=None):
        """h -> h'. x: input_layernorm(h) when the caller has it; next_norm: return (h', next_norm(h')) instead,
        each residual add and the norm after it one kernel on the fast path (``ops.add_norm``)."""
        x = ops.norm(self.input_layernorm, h) if x is None else x
        h, x = ops.add_norm(h, self.self_attn(x, cos, sin, keys_values, mask, ops), self.post_attention_layernorm)
        out = self.mlp(x, ops)
        return h + out if next_norm is None else ops.add_norm(h, out, next_norm)


# ---------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------


class DFlashLagunaDrafter(nn.Module):
    """vLLM 0.33's DFlashLagunaForCausalLM, as plain torch (no embedding, no lm_head).

    ``window`` is the attention window the drafter drafts with: the config's (vLLM serves
    that), or another one set with ``with_window``. Causality is always vLLM's rule on the
    config (``config.is_causal``).
    """

    def __init__(self, config: DFlashDrafterConfig):
        super().__init__()
        if not isinstance(config, DFlashDrafterConfig):
            raise TypeError(f"config must be a DFlashDrafterConfig, got {type(config).__name__}")
        self.config = config
        self.window = config.window
        n_aux = len(config.target_layer_ids)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.aux_hidden_norms = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                              for _ in range(n_aux))
        self.fc = nn.Linear(n_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The batched/folded paths' stacked weights, built once per (device, dtype) as vLLM builds
        # its context-K/V buffers once after loading (context_kv.build_context_kv_buffers). Shared
        # by with_window views; dropped whenever the weights may change (see refresh_context_kv_buffers).
        self.context_kv_buffers: dict = {}
        for layer in self.layers:  # the fast path's ops.linears keep qkv|g and gate|up stacked here too
            layer.self_attn.stacked = layer.mlp.stacked = self.context_kv_buffers
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh_context_kv_buffers())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        self.refresh_context_kv_buffers()

    # --- the stacked context-K/V weights: when they are rebuilt ----------------------
    def refresh_context_kv_buffers(self) -> None:
        """Drop the stacked/folded weights; the next batched or folded call rebuilds them.

        Runs by itself after ``load_state_dict``, ``reset_parameters``, ``.to(...)`` and
        ``train()`` (an optimizer is about to change the weights). Call it after editing
        weights in place yourself (``with torch.no_grad(): w.mul_(2)``).
        """
        self.context_kv_buffers.clear()

    def train(self, mode: bool = True):
        if mode:
            self.refresh_context_kv_buffers()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self.refresh_context_kv_buffers()
        return super()._apply(fn, *args, **kwargs)

    # --- naming --------------------------------------------------------------
    @property
    def target_layer_count(self) -> int:
        n = self.config.target_layer_count
        return n if n is not None else max(self.config.target_layer_ids) + 1

    def attention_layer_names(self) -> list[str]:
        """vLLM's attention-layer names: drafter layer j is layer target_layer_count + j."""
        return [f"model.layers.{self.target_layer_count + j}.self_attn.attn" for j in range(len(self.layers))]

    # --- step 1: target features -> drafter context ---------------------------
    def combine_hidden_states(self, aux: torch.Tensor, ops=TorchOps) -> torch.Tensor:
        """(N, n_aux * H_t) aux hidden states -> (N, H) drafter context."""
        n_aux, ht = len(self.aux_hidden_norms), self.config.target_hidden_size
        if aux.shape[-1] != n_aux * ht:
            raise ValueError(
                f"aux hidden states have last dim {aux.shape[-1]}, expected {n_aux} target layers x "
                f"hidden {ht} = {n_aux * ht}"
            )
        return ops.norm(self.hidden_norm, self.fc(ops.norms(self.aux_hidden_norms, aux,
                                                                      self.context_kv_buffers)))

    # --- step 2: context K/V (the three paths live in context_kv.py) ------------
    def precompute_context_kv(self, context: torch.Tensor, positions: torch.Tensor, path: str = "folded", *,
                              fused: bool | None = None):
        """Every drafter layer's K (after K-norm and RoPE) and V for the context.

        context: (N, H); positions: (N,). Returns K, V each (L, N, nkv, hd).
        path: one of context_kv.CONTEXT_KV_PATHS ("reference", "batched", "folded").
        fused (folded path only): None = the fused Triton kernel where it can run
        (CUDA, see dflash_lab.context_kv_kernel), False = torch ops, True = insist on it.
        """
        if context.dim() != 2 or context.shape[-1] != self.config.hidden_size:
            raise ValueError(f"context must be (N, {self.config.hidden_size}), got {tuple(context.shape)}")
        if positions.shape != context.shape[:1]:
            raise ValueError(f"positions must be ({context.shape[0]},), got {tuple(positions.shape)}")
        return compute_context_kv(self, context, positions, path, fused=fused)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor, path: str = "folded", *, ops=TorchOps):
        """Steps 1 and 2 together: target aux features (N, n_aux * H_t) at positions (N,) -> K, V (L, N, nkv, hd).

        What every backend appends to its context store, and what training attends to.
        """
        return self.precompute_context_kv(self.combine_hidden_states(aux, ops=ops), positions, path)

    def block_logits(self, target, first: torch.Tensor, positions: torch.Tensor, *, from_slot: int = 1,
                     **forward_kwargs) -> torch.Tensor:
        """Blocks [x_t, MASK x (Q-1)] through the target's embedding table, the drafter and the target's lm_head.

        first: (B, A) the x_t of A blocks per row; positions: (B, A*Q) their slots' positions.
        Returns (B, A, Q - from_slot, V): slot j >= 1 predicts the token AT t+j (slot 0 only matters in training).
        ``forward_kwargs`` go to ``forward`` (the context K/V or ``kv=``, ``mask``, ``ops``).
        """
        B, A = first.shape
        Q = positions.shape[1] // A
        ids = draft_block_ids(first, Q, self.config.mask_token_id).flatten(1)  # (B, A*Q)
        hidden = self(target.get_input_embeddings()(ids), positions, block_size=Q, **forward_kwargs)
        return target.lm_head(hidden.unflatten(1, (A, Q))[:, :, from_slot:])

    # --- step 3: one block through the drafter ----------------------------------
    def forward(self, noise_embeds: torch.Tensor, positions: torch.Tensor, context_k: torch.Tensor | None = None,
                context_v: torch.Tensor | None = None, context_positions: torch.Tensor | None = None, *,
                kv: ConcatKV | SlotKV | None = None, block_size: int | None = None,
                mask: torch.Tensor | None = None, ops=TorchOps) -> torch.Tensor:
        """Draft hidden states for one or more blocks.

        noise_embeds: (B, Q, H) target embeddings of [x_t, mask, mask, ...] per block
        positions:    (B, Q) absolute positions of the block tokens
        context_k/v:  (L, N, nkv, hd) or (L, B, N, nkv, hd) from precompute_context_kv, at
                      context_positions (N,) or (B, N) — or instead ``kv``, a K/V store
                      (``ConcatKV`` or ``SlotKV``)
        block_size:   tokens per block (default: Q, one block)
        mask:         (B, Q, keys) bool or additive, default ``kv.mask`` with vLLM's causality and ``self.window``
                      (over ``SlotKV`` with ops that carry the attention kernel: ``kv.visibility``, no mask)
        ops:          how norms run (``layers.TorchOps``; the fast path passes one-kernel versions)
        Returns (B, Q, H), after the final norm; feed to the target's lm_head.
        """
        if kv is None:
            kv = ConcatKV(context_k, context_v, context_positions)
        if kv.k.shape[0] != len(self.layers):
            raise ValueError(f"context K/V hold {kv.k.shape[0]} layers, the drafter has {len(self.layers)}")
        if mask is None:
            fused = isinstance(kv, SlotKV) and getattr(ops, "attention_usable", lambda x: False)(noise_embeds)
            mask = (kv.visibility if fused else kv.mask)(positions, block_size or positions.shape[1],
                                                         causal=self.config.is_causal, window=self.window)
        if not isinstance(mask, SlotVisibility):
            groups = self.config.num_attention_heads // self.config.num_key_value_heads
            mask = grouped_mask(mask, groups, *noise_embeds.shape[:2])  # once, for every layer
        table = (isinstance(mask, SlotVisibility) and hasattr(ops, "qk_rope_write")
                 and getattr(kv, "rope", None) is not None)
        # the fast path reads a table made once at every slot's position (slot == position); else computed here
        cos, sin = kv.rope if table else rope_tables(self.config, positions, noise_embeds.dtype)
        x = ops.norm(self.layers[0].input_layernorm, noise_embeds)
        h, norms = noise_embeds, [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, layer in enumerate(self.layers):  # each layer hands the next its normed input (the last: the final)
            h, x = layer(h, cos, sin, kv.layer(i, positions), mask, ops, x=x, next_norm=norms[i])
        return x


def with_window(drafter: DFlashLagunaDrafter, window: int | None) -> DFlashLagunaDrafter:
    """The same weights, drafting with attention window ``window`` (None: no window).

    The window is a compute-time limit only (the context K/V store stays full), so it can
    be changed at inference time: ``speculative_generate(target, with_window(drafter, 64),
    ...)``; every backend reads ``drafter.window``. Only the window changes: causality and
    RoPE stay those of the config. (In vLLM, making a layer sliding also makes it causal and
    gives it the sliding RoPE entry; this view is a lab experiment, not a config vLLM serves.)
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    view = copy.copy(drafter)  # a new module object over the same submodules, parameters and buffers
    view.window = window
    return view
