"""What a decode step must read from memory, and the time that takes: the floor a step is measured against.

At batch 1 a step of a large model is memory-bound: every weight it uses is read once,
and nothing else needs to take long. The floor of a step is therefore

    bytes it must read / memory bandwidth

with the bytes counted here from the configs (bf16: 2 bytes a parameter):

    target, B tokens   every layer's attention weights and norms; its KV cache up to the
                       block (full layers: context + B slots; sliding layers: the window + B);
                       the dense MLP, or the router, the shared expert and the DISTINCT routed
                       experts the B tokens chose (``distinct``: one count per sparse layer, or
                       one number for all); the final norm and the lm_head (a verify step needs
                       the logits of every block position)
    drafter, block B   every drafter layer's weights; its context K/V within the window + B; the
                       fc over the aux features and the shared lm_head; the context K/V
                       projection of the appended positions reads the same k/v weights again

The bandwidth is the H200's 4.8 TB/s by its datasheet, or a copy bandwidth measured in the
same run (``bench_xs2_steps``). Nothing here touches a GPU.
"""

from __future__ import annotations

NOMINAL_BANDWIDTH = 4.8e12  # bytes/s, H200 HBM3e datasheet


def _attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, per_head_gate: bool = True) -> int:
    q = o = heads * head_dim * hidden
    kv = 2 * kv_heads * head_dim * hidden
    gate = heads * hidden if per_head_gate else heads * head_dim * hidden
    return q + kv + o + gate + 2 * head_dim + 2 * hidden  # + q/k head norms, input/post norms


def target_step_bytes(cfg, block: int, context: int, distinct, *, dtype_bytes: int = 2) -> dict:
    """Bytes one target forward over ``block`` tokens reads, by part. ``cfg``: a transformers LagunaConfig.

    distinct: distinct routed experts per sparse layer (a list, one per sparse layer) or one number for all.
    """
    H, hd, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
    heads = getattr(cfg, "num_attention_heads_per_layer", None) or [cfg.num_attention_heads] * cfg.num_hidden_layers
    mlp_types = list(getattr(cfg, "mlp_layer_types", None) or ["sparse"] * cfg.num_hidden_layers)
    n_sparse = mlp_types.count("sparse")
    per_layer = list(distinct) if isinstance(distinct, (list, tuple)) else [distinct] * n_sparse
    if len(per_layer) != n_sparse:
        raise ValueError(f"distinct has {len(per_layer)} entries for {n_sparse} sparse layers")
    expert = 3 * H * cfg.moe_intermediate_size
    params = {"attention": 0, "dense_mlp": 0, "router_and_shared": 0, "routed_experts": 0}
    kv_slots = 0
    sparse_i = 0
    for i, layer_type in enumerate(cfg.layer_types):
        params["attention"] += _attention_params(H, heads[i], nkv, hd, cfg.gating in (True, "per-head"))
        seen = context + block if layer_type == "full_attention" else min(context, cfg.sliding_window) + block
        kv_slots += seen
        if mlp_types[i] == "dense":
            params["dense_mlp"] += 3 * H * cfg.intermediate_size
        else:
            params["router_and_shared"] += cfg.num_experts * H + 3 * H * cfg.shared_expert_intermediate_size
            params["routed_experts"] += per_layer[sparse_i] * expert
            sparse_i += 1
    params["lm_head_and_embeddings"] = cfg.vocab_size * H + block * H + H
    parts = {k: v * dtype_bytes for k, v in params.items()}
    parts["kv_cache"] = kv_slots * 2 * nkv * hd * dtype_bytes
    return {"parts": parts, "total": sum(parts.values())}


def drafter_step_bytes(d: dict, block: int, context: int, *, dtype_bytes: int = 2) -> dict:
    """Bytes one drafter step (draft a block of ``block`` + append its context K/V) reads. ``d``: config.json dict."""
    H, hd, nkv, heads = d["hidden_size"], d["head_dim"], d["num_key_value_heads"], d["num_attention_heads"]
    L = d["num_hidden_layers"]
    n_aux = len(d["dflash_config"]["target_layer_ids"])
    target_hidden = d.get("target_hidden_size") or H
    per_head = d.get("gating", True) in (True, "per-head")
    layer = _attention_params(H, heads, nkv, hd, per_head) + 3 * H * d["intermediate_size"]
    window = d.get("sliding_window") if set(d["layer_types"]) == {"sliding_attention"} else None
    seen = (min(context, window) if window else context) + block
    parts = {
        "layers": L * layer * dtype_bytes,
        "context_kv_projection": L * 2 * nkv * hd * H * dtype_bytes,  # the append reads k/v weights again
        "fc_and_norms": (n_aux * target_hidden * H + (n_aux + 2) * target_hidden) * dtype_bytes,
        "lm_head_and_embeddings": (d["draft_vocab_size"] * H + block * H) * dtype_bytes,
        "kv_cache": L * seen * 2 * nkv * hd * dtype_bytes,
    }
    return {"parts": parts, "total": sum(parts.values())}


def floor_ms(n_bytes: float, bandwidth: float = NOMINAL_BANDWIDTH) -> float:
    """Milliseconds to read ``n_bytes`` at ``bandwidth`` bytes/s."""
    return 1e3 * n_bytes / bandwidth
