"""The Laguna target: transformers' ``LagunaForCausalLM`` and its aux hidden states.

The drafter is conditioned on the outputs of a few target layers
(``dflash_config.target_layer_ids``). ``target_forward`` runs the target once
(prefill or an incremental step with its own KV cache) and returns the logits
together with those layers' outputs, concatenated along the hidden dim, ready
for ``DFlashLagunaDrafter.combine_hidden_states``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LagunaConfig, LagunaForCausalLM

from .runtime import resolve_device_and_dtype


def tiny_laguna_config(vocab_size: int = 4096, **overrides) -> LagunaConfig:
    """A small Laguna that keeps the family's character.

    Hybrid attention (sliding, sliding, full) x 2 with a different RoPE per
    type, a dense first layer then sparse MoE layers with a shared expert, and
    per-head softplus output gating.
    """
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,  # the dense first layer's MLP
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=64,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
        mlp_layer_types=["dense"] + ["sparse"] * 5,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        gating=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return LagunaConfig(**kw)


def build_target(config: LagunaConfig, *, seed: int | None = None) -> LagunaForCausalLM:
    if seed is not None:
        torch.manual_seed(seed)
    model = LagunaForCausalLM(config)
    model.eval()
    return model


def load_target(path, *, device="cpu", dtype=None) -> LagunaForCausalLM:
    """Load a LagunaForCausalLM from a local directory (safetensors only, offline)."""
    device, dtype = resolve_device_and_dtype(device, dtype, "load_target")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no target config.json in {path}")
    weights = list(path.glob("*.safetensors"))
    if not weights:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {pickles}: pickled weights are refused)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    model = LagunaForCausalLM.from_pretrained(
        path, dtype=dtype or "auto", local_files_only=True, use_safetensors=True,
    )
    return model.to(device).eval()


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (B, T, V); None with with_logits=False
    aux_hidden: torch.Tensor  # (B, T, len(layer_ids) * H): outputs of the chosen layers
    past_key_values: object  # transformers Cache
    final_hidden: torch.Tensor | None = None  # (B, T, H) after the final norm; only with with_logits=False


def target_forward(target: LagunaForCausalLM, input_ids: torch.Tensor, layer_ids, *, past_key_values=None,
                   use_cache: bool = True, position_ids: torch.Tensor | None = None,
                   with_logits: bool = True, attention_mask=None) -> TargetOutput:
    """One target forward that also captures the outputs of ``layer_ids``.

    The output of layer i is what transformers calls hidden_states[i + 1]; it
    is captured with forward hooks on the decoder layers so that the last
    layer's output is the raw residual stream, not the final-normed state.
    ``with_logits=False`` skips the LM head and returns the final-normed hidden
    state instead (drafter training needs the logits at a few positions only). ``attention_mask``: as
    transformers takes it (a tree's verification passes {layer type: 4-D mask}).
    """
    layers = target.model.layers
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer_ids {bad} do not exist in a target with {len(layers)} layers")
    captured: dict[int, torch.Tensor] = {}
    def keep(i):  # a hook that keeps layer i's output (the hidden states, when it returns a tuple)
        return lambda m, a, out: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = [layers[i].register_forward_hook(keep(i))
             for i in layer_ids]
    try:
        run = target if with_logits else target.model
        out = run(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache, position_ids=position_ids,
                  attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1)
    if with_logits:
        return TargetOutput(out.logits, aux, out.past_key_values)
    return TargetOutput(None, aux, out.past_key_values, final_hidden=out.last_hidden_state)


def target_layer_ids_spread(num_target_layers: int, n: int) -> list[int]:
    """n layer ids spread over the target's depth, ending one before the last layer.

    DFlash reads early, middle and late features; like published DFlash
    drafters, it skips layer 0 and the final layer.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    lo, hi = 1, max(1, num_target_layers - 2)
    if n == 1:
        return [hi]
    return sorted({round(lo + (hi - lo) * k / (n - 1)) for k in range(n)})
