"""A pair in the format a researcher brings: what the lab must run on besides its own.

    python -m dflash_lab.user_pair --out /tmp/my-pair            # CPU-sized, seconds
    export DFLASH_LAB_TARGET=/tmp/my-pair/target DFLASH_LAB_DRAFTER=/tmp/my-pair/drafter

``build_user_pair`` writes, with random weights:

- ``target/``: transformers' ``LagunaForCausalLM`` saved by ``save_pretrained`` as several
  safetensors shards with ``model.safetensors.index.json``, in Laguna-XS.2's layer pattern
  (one full to three sliding layers, YaRN RoPE with a half rotary on the full ones, a dense
  first layer then MoE with a shared expert, fewer query heads on the full layers), with
  its own byte-level BPE tokenizer, so its vocabulary is nothing like the shipped 4096;
- ``drafter/``: a drafter at the Laguna-XS-2.1-DFlash preset's shape (five sliding, causal
  layers, window 512) with its widths shrunk to the target's, saved by ``save_drafter``.

Its numbers mean nothing (random weights: τ near 1); it exists so that every chapter and
tool can be run on a pair that is not the shipped one. ``--full-width`` builds the same
layout at Laguna-XS.2's true widths (hidden 2048, 256 experts, vocabulary 100352) for a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .runtime import HELDOUT_PROMPTS, DOCSTRING_PROMPTS, atomic_directory

XS2_PERIOD = ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention")
DRAFTER_PRESET = "laguna-xs-2.1-dflash (shape)"

# CPU-sized widths; every behaviour-deciding key (layer pattern, RoPE, MoE routing, gating) as XS.2.
SMALL = dict(hidden_size=128, head_dim=32, num_key_value_heads=2, heads_full=2, heads_sliding=4,
             intermediate_size=384, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, sliding_window=64, drafter_intermediate_size=256)
# Laguna-XS.2's published widths (config.json), for a GPU.
FULL = dict(hidden_size=2048, head_dim=128, num_key_value_heads=8, heads_full=48, heads_sliding=64,
            intermediate_size=8192, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, sliding_window=512, drafter_intermediate_size=8192)


def xs2_target_config(num_layers: int, vocab_size: int, *, widths: dict = SMALL, max_positions: int = 4096):
    """transformers' ``LagunaConfig`` in Laguna-XS.2's layout at ``widths`` (SMALL or FULL)."""
    from transformers import LagunaConfig

    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2 (one full and one sliding layer), got {num_layers}")
    layer_types = [XS2_PERIOD[i % 4] for i in range(num_layers)]
    w = widths
    return LagunaConfig(
        vocab_size=vocab_size, hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
        num_hidden_layers=num_layers, num_attention_heads=w["heads_sliding"],
        num_attention_heads_per_layer=[w["heads_full"] if t == "full_attention" else w["heads_sliding"]
                                       for t in layer_types],
        num_key_value_heads=w["num_key_value_heads"], head_dim=w["head_dim"], layer_types=layer_types,
        sliding_window=w["sliding_window"],
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                               "original_max_position_embeddings": 4096, "beta_slow": 1.0, "beta_fast": 64.0,
                               "attention_factor": 1.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
        num_experts=w["num_experts"], num_experts_per_tok=w["num_experts_per_tok"],
        moe_intermediate_size=w["moe_intermediate_size"],
        shared_expert_intermediate_size=w["shared_expert_intermediate_size"],
        gating=True, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def xs21_drafter_dict(target_config, *, widths: dict = SMALL, num_layers: int | None = None) -> dict:
    """The Laguna-XS-2.1-DFlash preset's config.json, fitted to ``target_config``: its widths and vocabulary,
    its feature layers spread over the target's depth (both layer-id keys written, as vLLM reads them)."""
    from .presets import drafter_preset, shrink_drafter_config
    from .target import target_layer_ids_spread

    d, _ = drafter_preset(DRAFTER_PRESET)
    n = num_layers or d["num_hidden_layers"]
    d = shrink_drafter_config(d, hidden_size=target_config.hidden_size,
                              num_attention_heads=widths["heads_sliding"],
                              num_key_value_heads=widths["num_key_value_heads"], head_dim=widths["head_dim"],
                              intermediate_size=widths["drafter_intermediate_size"],
                              vocab_size=target_config.vocab_size)
    ids = target_layer_ids_spread(target_config.num_hidden_layers, n)
    d.update(num_hidden_layers=len(ids), layer_types=[d["layer_types"][0]] * len(ids),
             eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids])
    d["dflash_config"] = {**d["dflash_config"], "num_target_layers": target_config.num_hidden_layers,
                          "target_layer_ids": ids}
    return d


def _prompt_texts() -> list[str]:
    texts = []
    for path in (HELDOUT_PROMPTS, DOCSTRING_PROMPTS):
        texts += [p["text"] for p in json.loads(Path(path).read_text())["prompts"]]
    return texts


def build_user_pair(out_dir, *, num_layers: int = 8, vocab_size: int = 1536, full_width: bool = False,
                    shard_size: str = "2MB", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    device: str = "cpu") -> dict:
    """Write ``out_dir/target`` and ``out_dir/drafter`` (see the module docstring); returns their paths.

    vocab_size: the tokenizer is trained to at most this size on the lab's prompt texts, and the model's
    vocabulary is the tokenizer's rounded up to a multiple of 64 (as real checkpoints pad theirs).
    Each directory is written whole or not at all.
    """
    from .checkpoint import save_drafter
    from .config import DFlashDrafterConfig
    from .drafter import DFlashLagunaDrafter
    from .target import build_target
    from .train.tokenizer import save_tokenizer, train_tokenizer

    out = Path(out_dir)
    widths = FULL if full_width else SMALL
    tok = train_tokenizer(_prompt_texts(), vocab_size)
    vocab = 100352 if full_width else -(-tok.get_vocab_size() // 64) * 64
    if vocab == 4096:
        vocab += 64  # never the shipped vocabulary's size
    cfg = xs2_target_config(num_layers, vocab, widths=widths)
    with torch.device(device):  # a full-width target is built where it fits (a GPU's memory)
        target = build_target(cfg, seed=seed).to(dtype)
        drafter = DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(xs21_drafter_dict(cfg, widths=widths)))

    def write_pair(tmp: Path) -> None:
        target.save_pretrained(str(tmp / "target"), max_shard_size=shard_size, safe_serialization=True)
        save_tokenizer(tok, tmp / "target")
        save_drafter(drafter.to(dtype), tmp / "drafter")

    if out.exists() and (not out.is_dir() or not set(p.name for p in out.iterdir()) <= {"target", "drafter"}):
        raise FileExistsError(f"build_user_pair: `out_dir` {out} exists and is not a pair this builder wrote; "
                              "refusing to replace it")
    atomic_directory(out, write_pair)  # the pair is written whole or not at all
    return {"target": out / "target", "drafter": out / "drafter"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash_lab.user_pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write target/ and drafter/ into")
    p.add_argument("--layers", type=int, default=8, help="target layers (Laguna-XS.2 has 40)")
    p.add_argument("--vocab-size", type=int, default=1536, help="tokenizer size to train (model vocab rounds up)")
    p.add_argument("--full-width", action="store_true", help="Laguna-XS.2's true widths (GPU memory)")
    p.add_argument("--shard-size", default="2MB", help="max_shard_size passed to save_pretrained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the weights are initialised (cuda for --full-width)")
    a = p.parse_args(argv)
    paths = build_user_pair(a.out, num_layers=a.layers, vocab_size=a.vocab_size, full_width=a.full_width,
                            shard_size=a.shard_size, seed=a.seed, device=a.device)
    print(f"export DFLASH_LAB_TARGET={paths['target']} DFLASH_LAB_DRAFTER={paths['drafter']}")


if __name__ == "__main__":
    main()
