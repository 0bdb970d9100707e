"""The DFlash drafter step over preallocated context K/V, with no host copies or syncs.

The eager proposer (``proposers.py``) keeps the context K/V in a buffer sized for
the whole generation, then concatenates the block's K/V to it in every layer.
Here the buffer is (L, batch, S, nkv, hd) and slot == position, as the target's
cache (``static_target.py``):

    append   the context K/V of a block's positions (the folded path, fused kernel
             on CUDA), scattered at their slots. The loop appends ALL B block
             positions every step; only the accepted ones (slots < the new context
             length) are ever visible, and the rejected ones are overwritten by the
             next step's append before that
    draft    [x_t, MASK x (B-1)] at positions t .. t+B-1: each layer writes the
             block's own K/V at slots t .. t+B-1 (in place, no concatenation) and
             attends to slots < t (the context) and t .. t+B-1 (the block; causal
             or not, windowed or not, as ``dflash_attention_mask``); the target's
             lm_head and an argmax give the B-1 drafts

The context length of sequence b is t_b: its last emitted token x_t is not yet
context (its target features come from the next verification).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...layers import apply_rope
from . import triton_ops
from .static_target import additive_mask, gqa_attention, round_up


def _window_of(drafter) -> int | None:
    """The drafter's attention window, honouring a ``with_window`` view (a partial with window=...)."""
    fwd = drafter.__dict__.get("forward")
    if isinstance(fwd, functools.partial) and "window" in fwd.keywords:
        return fwd.keywords["window"]
    return drafter.config.window


class StaticDrafter:
    """Context K/V buffers and the block forward of a ``DFlashLagunaDrafter`` for ``batch`` sequences."""

    def __init__(self, drafter, target, *, batch: int, capacity: int):
        cfg = drafter.config
        p = next(drafter.parameters())
        self.drafter, self.config, self.device, self.dtype = drafter, cfg, p.device, p.dtype
        self.embed, self.lm_head = target.get_input_embeddings(), target.lm_head
        self.batch, self.capacity = batch, round_up(capacity, 16)
        L = len(drafter.layers)
        shape = (L, batch, self.capacity, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(self.capacity, device=self.device)
        self.window, self.causal = _window_of(drafter), cfg.is_causal
        self.mask_token = torch.tensor(cfg.mask_token_id, device=self.device)
        self.w_in = [torch.cat([l.self_attn.qkv_proj.weight] + ([l.self_attn.g_proj.weight] if cfg.gating else []))
                     for l in drafter.layers]
        self.b_in = [None if l.self_attn.qkv_proj.bias is None else torch.cat(
            [l.self_attn.qkv_proj.bias] + ([l.self_attn.g_proj.weight.new_zeros(l.self_attn.g_proj.weight.shape[0])]
                                           if cfg.gating else [])) for l in drafter.layers]

    # --- context ---------------------------------------------------------------
    def append(self, aux: torch.Tensor, positions: torch.Tensor) -> None:
        """Context K/V of target features aux (B, Q, n_aux * H_t) at positions (B, Q), written at those slots."""
        B, Q, _ = aux.shape
        d = self.drafter
        context = self._combine(aux.reshape(B * Q, -1))  # (B*Q, H)
        k, v = d.precompute_context_kv(context, positions.reshape(-1))  # (L, B*Q, nkv, hd) each
        L, _, nkv, hd = k.shape
        index = positions[None, :, :, None, None].expand(L, B, Q, nkv, hd)
        self.k.scatter_(2, index, k.view(L, B, Q, nkv, hd))
        self.v.scatter_(2, index, v.view(L, B, Q, nkv, hd))

    def _combine(self, aux: torch.Tensor) -> torch.Tensor:
        """``combine_hidden_states`` with each RMSNorm one kernel: (N, n_aux * H_t) -> (N, H)."""
        d = self.drafter
        slices = aux.unflatten(-1, (len(d.aux_hidden_norms), self.config.target_hidden_size))  # (N, n_aux, H_t)
        normed = torch.stack([triton_ops.norm(n, slices[:, i]) for i, n in enumerate(d.aux_hidden_norms)], dim=-2)
        return triton_ops.norm(d.hidden_norm, d.fc(normed.flatten(-2)))

    # --- one block ---------------------------------------------------------------
    def _bias(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, Q, S) additive mask of ``dflash_attention_mask``, in slot terms (slot == position)."""
        start = positions[:, :1, None]  # (B, 1, 1) t: the context is slots < t
        pos = positions[:, :, None]  # (B, Q, 1)
        visible = self.slots < start + positions.shape[1]  # context + the whole block
        if self.causal:
            visible &= (self.slots < start) | (self.slots <= pos)
        if self.window is not None:
            visible &= (pos - self.slots).abs() < self.window
        return additive_mask(visible, self.dtype)

    def draft(self, last_token: torch.Tensor, start: torch.Tensor, block_size: int) -> torch.Tensor:
        """Greedy drafts (B, block_size - 1) for blocks [last_token, MASK ...] at positions start .. start+block_size-1."""
        d, cfg = self.drafter, self.config
        B = last_token.shape[0]
        ids = torch.cat([last_token[:, None], self.mask_token.expand(B, block_size - 1)], dim=1)  # (B, Q)
        positions = start[:, None] + self.slots[:block_size]  # (B, Q)
        h = self.embed(ids)  # (B, Q, H): the target's embedding table
        cos, sin = d.rope_tables(positions, h.dtype)
        bias = self._bias(positions)
        index = positions[:, :, None, None].expand(B, block_size, cfg.num_key_value_heads, cfg.head_dim)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            x = triton_ops.norm(layer.input_layernorm, h)
            proj = F.linear(x, self.w_in[i], self.b_in[i])
            q, k, v = proj[..., :a.q_size], proj[..., a.q_size:a.q_size + a.kv_size], proj[..., a.q_size + a.kv_size:a.q_size + 2 * a.kv_size]
            q = triton_ops.norm_rope(a.q_norm, q, cos, sin, a.num_heads, a.head_dim, apply_rope)  # (B, Q, nh, hd)
            k = triton_ops.norm_rope(a.k_norm, k, cos, sin, a.num_kv_heads, a.head_dim, apply_rope)  # (B, Q, nkv, hd)
            self.k[i].scatter_(1, index, k)  # the block's own K/V, in place at slots t .. t+Q-1
            self.v[i].scatter_(1, index, v.unflatten(-1, (a.num_kv_heads, a.head_dim)))
            out = gqa_attention(q, self.k[i].transpose(1, 2), self.v[i].transpose(1, 2), bias, a.head_dim**-0.5)
            if a.gating:
                gate = F.softplus(proj[..., a.q_size + 2 * a.kv_size:].float()).to(out.dtype)
                out = out.unflatten(-1, (a.num_heads, a.head_dim))
                out = (out * (gate.unsqueeze(-1) if a.gate_per_head else gate.unflatten(-1, (a.num_heads, a.head_dim))))
                out = out.flatten(-2)
            h = h + a.o_proj(out)
            h = h + layer.mlp(triton_ops.norm(layer.post_attention_layernorm, h))
        h = triton_ops.norm(d.norm, h)
        return self.lm_head(h[:, 1:]).argmax(dim=-1)  # (B, Q-1): position j predicts the token AT t+j
