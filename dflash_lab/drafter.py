"""The Laguna DFlash drafter, in the order data flows through it.

    target aux hidden states [N, n_aux * H_t]
        -> combine_hidden_states      (per-slice RMSNorm, concat, fc, hidden_norm)   [N, H]
        -> precompute_context_kv      (every layer's K/V of the context, once;
                                       three paths in context_kv.py)                 [L, N, nkv, hd]
    block = [last token, mask x (B-1)], embedded with the TARGET's embedding table   [B, H]
        -> forward                    (L decoder layers; queries = the block,
                                       keys/values = [context K/V ; block K/V],
                                       no causal mask inside the block)               [B, H]
        -> the target's lm_head       (position j >= 1 predicts the token AT j)

Parameter names match vLLM 0.33's ``DFlashLagunaForCausalLM`` checkpoint layout
(``layers.0.self_attn.qkv_proj.weight``, ``fc.weight``, ...), so a state dict of
this module is a vLLM drafter checkpoint. The drafter owns no embedding and no
lm_head: both are the target's. RMSNorm and RoPE come from ``layers.py``.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashDrafterConfig
from .context_kv import compute_context_kv
from .layers import RMSNorm, apply_rope, rope_cos_sin

# ---------------------------------------------------------------------------
# Layers (Laguna-flavoured)
# ---------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Laguna attention: fused qkv, per-head q/k RMSNorm, partial RoPE, softplus gate."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
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

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V of already-normalised inputs x (..., H)."""
        kv = F.linear(x, self.qkv_proj.weight[self.q_size :],
                      None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :])
        k, v = kv.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(-3)  # (..., nkv, hd) each
        return apply_rope(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x: (B, Q, H) normalised block states; ctx_k/ctx_v: (B, N, nkv, hd); mask: (B, Q, N+Q) bool."""
        B, Q, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)  # (B, Q, nh, hd)
        k = apply_rope(self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))), cos, sin)  # (B, Q, nkv, hd)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        keys = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # (B, nkv, N+Q, hd)
        values = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # (B, nh, Q, hd)
        out = out.transpose(1, 2)  # (B, Q, nh, hd)
        if self.gating:
            gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
            out = out * (gate.unsqueeze(-1) if self.gate_per_head else gate.unflatten(-1, (self.num_heads, self.head_dim)))
        return self.o_proj(out.flatten(-2))


class DFlashMLP(nn.Module):
    """Dense SiLU MLP (drafter layers are never MoE)."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------
# Which keys a block query may see
# ---------------------------------------------------------------------------


def dflash_attention_mask(positions: torch.Tensor, context_positions: torch.Tensor, block_size: int,
                          window: int | None = None, *, causal: bool = False) -> torch.Tensor:
    """Boolean (B, Q, N+Q) mask, True where query q may attend to key k.

    ``positions`` (B, Q) holds Q = num_blocks * block_size block positions, each
    block contiguous. A query sees (a) context keys strictly before its block's
    first position and (b) keys of its own block: all of them, or with ``causal``
    only those at or before its own position (vLLM makes sliding drafter layers
    causal, FIDELITY §1). A sliding ``window`` limits compute, not the K/V store:
    causal layers see keys with q_pos - k_pos < window (vLLM's window (w, 0));
    non-causal layers see |q_pos - k_pos| < window in both directions (vLLM's
    ``_maybe_symmetrize_window`` turns (w, 0) into (w, w)).
    """
    B, Q = positions.shape
    if Q % block_size:
        raise ValueError(f"positions has {Q} block tokens, not a multiple of block_size {block_size}")
    if context_positions.dim() == 1:
        context_positions = context_positions.expand(B, -1)
    nb = Q // block_size
    start = positions.view(B, nb, block_size)[..., :1].expand(B, nb, block_size).reshape(B, Q)  # block start per query
    ctx = context_positions[:, None, :] < start[:, :, None]  # (B, Q, N)
    block_id = torch.arange(nb, device=positions.device).repeat_interleave(block_size)
    blk = (block_id[:, None] == block_id[None, :]).expand(B, Q, Q)  # (B, Q, Q)
    ctx_dist = positions[:, :, None] - context_positions[:, None, :]  # (B, Q, N) q_pos - k_pos
    blk_dist = positions[:, :, None] - positions[:, None, :]  # (B, Q, Q)
    if causal:
        blk = blk & (blk_dist >= 0)
    if window is not None:
        ctx = ctx & (ctx_dist.abs() < window)
        blk = blk & (blk_dist.abs() < window)  # |q - k| < w; for causal layers k <= q already holds
    return torch.cat([ctx, blk], dim=-1)


# ---------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------


class DFlashLagunaDrafter(nn.Module):
    """vLLM 0.33's DFlashLagunaForCausalLM, as plain torch (no embedding, no lm_head)."""

    def __init__(self, config: DFlashDrafterConfig):
        super().__init__()
        if not isinstance(config, DFlashDrafterConfig):
            raise TypeError(f"config must be a DFlashDrafterConfig, got {type(config).__name__}")
        self.config = config
        n_aux = len(config.target_layer_ids)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.aux_hidden_norms = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(n_aux))
        self.fc = nn.Linear(n_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
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

    # --- naming --------------------------------------------------------------
    @property
    def target_layer_count(self) -> int:
        n = self.config.target_layer_count
        return n if n is not None else max(self.config.target_layer_ids) + 1

    def attention_layer_names(self) -> list[str]:
        """vLLM's attention-layer names: drafter layer j is layer target_layer_count + j."""
        return [f"model.layers.{self.target_layer_count + j}.self_attn.attn" for j in range(len(self.layers))]

    # --- step 1: target features -> drafter context ---------------------------
    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """(N, n_aux * H_t) aux hidden states -> (N, H) drafter context."""
        n_aux, ht = len(self.aux_hidden_norms), self.config.target_hidden_size
        if aux.shape[-1] != n_aux * ht:
            raise ValueError(
                f"aux hidden states have last dim {aux.shape[-1]}, expected {n_aux} target layers x "
                f"hidden {ht} = {n_aux * ht}"
            )
        slices = aux.unflatten(-1, (n_aux, ht))  # (..., n_aux, H_t)
        normed = torch.stack([norm(slices[..., i, :]) for i, norm in enumerate(self.aux_hidden_norms)], dim=-2)
        return self.hidden_norm(self.fc(normed.flatten(-2)))

    # --- step 2: context K/V (the three paths live in context_kv.py) ------------
    def precompute_context_kv(self, context: torch.Tensor, positions: torch.Tensor, path: str = "folded", *,
                              fused: bool | None = None):
        """Every drafter layer's K (after K-norm and RoPE) and V for the context.

        context: (N, H); positions: (N,). Returns K, V each (L, N, nkv, hd).
        path: one of context_kv.CONTEXT_KV_PATHS ("reference", "batched", "folded").
        fused (folded path only): None = the fused Triton kernel where it can run
        (CUDA, see dflash_lab.kernels), False = torch ops, True = insist on it.
        """
        if context.dim() != 2 or context.shape[-1] != self.config.hidden_size:
            raise ValueError(f"context must be (N, {self.config.hidden_size}), got {tuple(context.shape)}")
        if positions.shape != context.shape[:1]:
            raise ValueError(f"positions must be ({context.shape[0]},), got {tuple(positions.shape)}")
        return compute_context_kv(self, context, positions, path, fused=fused)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.rotary_dim, float(self.config.rope.get("rope_theta", 10000.0)), dtype)

    # --- step 3: one block through the drafter ----------------------------------
    def forward(self, noise_embeds: torch.Tensor, positions: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, context_positions: torch.Tensor, *, block_size: int | None = None,
                window: int | None | str = "config", causal: bool | str = "config",
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Draft hidden states for one or more blocks.

        noise_embeds: (B, Q, H) target embeddings of [x_t, mask, mask, ...] per block
        positions:    (B, Q) absolute positions of the block tokens
        context_k/v:  (L, N, nkv, hd) or (L, B, N, nkv, hd) from precompute_context_kv
        context_positions: (N,) or (B, N)
        block_size:   tokens per block (default: Q, one block)
        window:       sliding window override (None = full); default from the config
        causal:       causal inside the block; default vLLM's rule on the config (sliding layers
                      causal unless `is_causal` / `dflash_config.causal` say otherwise)
        Returns (B, Q, H), after the final norm; feed to the target's lm_head.
        """
        B, Q, _ = noise_embeds.shape
        if context_k.dim() == 4:
            context_k, context_v = context_k.unsqueeze(1).expand(-1, B, -1, -1, -1), context_v.unsqueeze(1).expand(-1, B, -1, -1, -1)
        if context_k.shape[0] != len(self.layers):
            raise ValueError(f"context K/V hold {context_k.shape[0]} layers, the drafter has {len(self.layers)}")
        window = self.config.window if window == "config" else window
        causal = self.config.is_causal if causal == "config" else causal
        if mask is None:
            mask = dflash_attention_mask(positions, context_positions.to(positions.device), block_size or Q, window,
                                         causal=causal)
        cos, sin = self.rope_tables(positions, noise_embeds.dtype)
        h = noise_embeds
        for layer, ck, cv in zip(self.layers, context_k, context_v):
            h = layer(h, cos, sin, ck, cv, mask)
        return self.norm(h)


def with_window(drafter: DFlashLagunaDrafter, window: int | None) -> DFlashLagunaDrafter:
    """The same weights, whose forward always uses ``window`` (None: no window).

    The window is a compute-time limit only (the context K/V store stays full),
    so it can be changed at inference time: ``speculative_generate(target,
    with_window(drafter, 64), ...)``. Only the window changes: causality and RoPE stay
    those of the config. (In vLLM, making a layer sliding also makes it causal and gives
    it the sliding RoPE entry; this view is a lab experiment, not a config vLLM serves.)
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    view = copy.copy(drafter)  # a new module object over the same submodules and parameters
    view.forward = functools.partial(DFlashLagunaDrafter.forward, view, window=window)
    return view
