"""`python -m dflash_lab.train tokenizer|corpus|target|distill|drafter|evaluate`: options, then the stage's
run_* function."""

from __future__ import annotations

import argparse
import os

from .. import corpus
from ..config import DEFAULT_BLOCK_SIZE, LAYER_TYPES
from ..runtime import DEFAULT_DRAFTER, DEFAULT_TARGET, HELDOUT_PROMPTS, drafter_path, target_path
from . import code_corpus
from .distill import DistillConfig
from .drafter_config import ATTENTION_PRESETS, DEFAULT_PRESET, DrafterTrainConfig
from .drafter_training import run_distill, run_drafter
from .evaluate import run_evaluate
from .target_lm import TargetTrainConfig, run_target
from .tokenizer import run_tokenizer

DESCRIPTION = "Train the lab's tiny Laguna code model and its DFlash drafter."
CAUSAL_CHOICES = {"auto": None, "true": True, "false": False}  # --causal: auto = vLLM's rule by layer type


def add_common_options(sp) -> None:
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--corpus", default=None,
                    help="corpus root directory, or a corpus pack (`corpus` command; "
                         "default: this interpreter's stdlib)")
    sp.add_argument("--prompts", default=str(HELDOUT_PROMPTS), help="held-out prompt JSON")
    sp.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    sp.add_argument("--time-budget", type=float, default=None, help="seconds for the whole command")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_lab.train", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("tokenizer", help="train the BPE tokenizer and cut the held-out prompts (CPU)")
    add_common_options(sp)
    sp.add_argument("--out", default=str(DEFAULT_TARGET))
    sp.add_argument("--vocab-size", type=int, default=4096)
    sp.add_argument("--num-prompts", type=int, default=corpus.NUM_PROMPTS)
    sp.set_defaults(func=run_tokenizer)

    sp = sub.add_parser("corpus", help="pack the stdlib + permissively licensed installed packages' sources (CPU)")
    add_common_options(sp)
    sp.add_argument("--site-packages", default=None, help="default: this interpreter's site-packages")
    sp.add_argument("--max-bytes-per-package", type=int, default=2_000_000)
    sp.add_argument("--out", required=True, help=f"the pack file (name ending in {code_corpus.PACK_SUFFIX})")
    sp.set_defaults(func=code_corpus.run_corpus)

    sp = sub.add_parser("target", help="train the tiny Laguna target")
    add_common_options(sp)
    sp.add_argument("--tokenizer", default=str(DEFAULT_TARGET))
    sp.add_argument("--out", default=str(DEFAULT_TARGET))
    sp.add_argument("--epochs", type=float, default=TargetTrainConfig.epochs)
    sp.add_argument("--batch-size", type=int, default=TargetTrainConfig.batch_size)
    sp.add_argument("--seq-len", type=int, default=TargetTrainConfig.seq_len)
    sp.add_argument("--lr", type=float, default=TargetTrainConfig.lr)
    sp.set_defaults(func=run_target)

    sp = sub.add_parser("distill", help="only generate self-distillation data (to share between drafters)")
    add_common_options(sp)
    add_distill_options(sp)
    sp.set_defaults(func=run_distill)

    sp = sub.add_parser("drafter", help="generate self-distillation data and train the DFlash drafter")
    add_common_options(sp)
    add_distill_options(sp)
    sp.add_argument("--out", default=str(DEFAULT_DRAFTER))
    sp.add_argument("--layers", type=int, default=None,
                    help=f"drafter depth (default {DrafterTrainConfig.num_layers}; with --init: its depth, or fewer)")
    sp.add_argument("--intermediate-size", type=int, default=None,
                    help=f"MLP width (default {DrafterTrainConfig.intermediate_size}; "
                         "with --init: its width, or wider)")
    sp.add_argument("--attention", choices=sorted(ATTENTION_PRESETS), default=None,
                    help="paper: full attention, non-causal; poolside: sliding window 64, causal "
                         "(sets the three options below, which still override it)")
    sp.add_argument("--layer-type", choices=LAYER_TYPES, default=None,
                    help=f"drafter layer type (default {DrafterTrainConfig.layer_type})")
    sp.add_argument("--sliding-window", type=int, default=None, help="sliding_attention layers: the window")
    sp.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default=None,
                    help="causal inside the block: auto = vLLM's rule (sliding layers causal); "
                         "true/false are written as dflash_config.causal")
    sp.add_argument("--block-size", type=int, default=DrafterTrainConfig.block_size)
    sp.add_argument("--steps", type=int, default=DrafterTrainConfig.steps)
    sp.add_argument("--batch-size", type=int, default=DrafterTrainConfig.batch_size)
    sp.add_argument("--lr", type=float, default=DrafterTrainConfig.lr)
    sp.add_argument("--warmup", type=int, default=DrafterTrainConfig.warmup)
    sp.add_argument("--lr-floor", type=float, default=DrafterTrainConfig.lr_floor,
                    help="the cosine schedule ends at this fraction of --lr (default %(default)s); split one long "
                         "schedule over sittings by ending the first high and starting the next there")
    sp.add_argument("--short-block-share", type=float, default=DrafterTrainConfig.short_block_share,
                    help="share of blocks trained at a random shorter length (serves smaller block sizes)")
    sp.add_argument("--init", default=None, help="continue training this drafter checkpoint")
    sp.add_argument("--gen-fraction", type=float, default=0.25, help="share of the time budget for data generation")
    sp.add_argument("--eval-prompts", type=int, default=corpus.NUM_PROMPTS,
                    help="held-out prompts to evaluate on (0: none)")
    sp.add_argument("--eval-blocks", default=str(DEFAULT_BLOCK_SIZE), help="comma-separated block sizes to evaluate")
    sp.set_defaults(func=run_drafter)

    sp = sub.add_parser("evaluate", help="acceptance of a target/drafter pair on the held-out prompts")
    add_common_options(sp)
    sp.add_argument("--target", default=str(target_path()), help="default: $DFLASH_LAB_TARGET, else the shipped one")
    sp.add_argument("--drafter", default=str(drafter_path()), help="default: $DFLASH_LAB_DRAFTER, else the shipped one")
    sp.add_argument("--eval-prompts", type=int, default=corpus.NUM_PROMPTS)
    sp.add_argument("--eval-blocks", default=f"{DEFAULT_BLOCK_SIZE},8,4")
    sp.add_argument("--update-log", action="store_true", help="write the numbers into the drafter's training log")
    sp.set_defaults(func=run_evaluate)
    return p


def add_distill_options(sp) -> None:
    sp.add_argument("--target", default=str(DEFAULT_TARGET))
    sp.add_argument("--num-sequences", type=int, default=DistillConfig.num_sequences)
    sp.add_argument("--continuation", type=int, default=DistillConfig.continuation)
    sp.add_argument("--gen-batch", type=int, default=DistillConfig.gen_batch)
    sp.add_argument("--min-distinct", type=int, default=DistillConfig.min_distinct,
                    help="drop continuations with fewer distinct tokens (degenerate repetition)")
    sp.add_argument("--data", default=None,
                    help="self-distillation data file (.safetensors): read if present, else written")
    sp.add_argument("--prefix-sources", default=None,
                    help="where prefixes come from, as stream=share pairs, e.g. distill=0.5,train_stdlib=0.5 "
                         "(streams: train, distill and their *_stdlib parts; default distill=0.5,train=0.5)")


def train_config_from_args(args) -> DrafterTrainConfig:
    """The drafter command's DrafterTrainConfig: --attention's preset with the options given on top
    (``DrafterTrainConfig.from_preset``, the one place they are merged), every field checked."""
    given = {"num_layers": args.layers, "intermediate_size": args.intermediate_size, "layer_type": args.layer_type,
             "sliding_window": args.sliding_window}
    overrides = {name: value for name, value in given.items() if value is not None}
    if args.causal is not None:
        overrides["causal"] = CAUSAL_CHOICES[args.causal]
    return DrafterTrainConfig.from_preset(
        args.attention or DEFAULT_PRESET, **overrides, block_size=args.block_size, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, lr_floor=args.lr_floor,
        short_block_share=args.short_block_share, seed=args.seed)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "drafter":
        args.train_config = train_config_from_args(args)  # a bad option fails here, before any data is generated
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args.func(args)
