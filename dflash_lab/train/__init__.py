"""Train the lab's tiny Laguna code model and its DFlash drafter.

    python -m dflash_lab.train tokenizer   # CPU, ~1 min: byte-level BPE + the held-out prompt set
    python -m dflash_lab.train corpus      # CPU, ~2 min: stdlib + licensed packages' sources -> a pack
    python -m dflash_lab.train target      # GPU: LagunaForCausalLM on a corpus's train split
    python -m dflash_lab.train distill     # GPU: self-distillation data only (shared by several drafters)
    python -m dflash_lab.train drafter     # GPU: self-distillation data + DFlash drafter
    python -m dflash_lab.train evaluate    # acceptance of a pair on the held-out prompts

One file per stage, in the order the recipe runs them:

    tokenizer         stage 1: byte-level BPE with the four specials first, and saving it
    code_corpus       stage 0/1: the stdlib plus permissively licensed installed packages, licences
                      recorded, held-out split by file path (a "corpus pack")
    target_lm         stage 2: corpus token streams, fixed windows, training the target
    distill           stage 3a: self-distillation data (the target's greedy continuations)
    objective         the DFlash objective: anchors, blocks, soft labels, position-weighted
                      loss, short-block masks, the target-feature cache
    drafter_config    what a drafter run trains: DrafterTrainConfig (shape, schedule, every field
                      checked), the attention recipes ATTENTION_PRESETS "paper" and "poolside" and
                      ``from_preset``, the one place a recipe meets the caller's options
    drafter_training  stage 3b: the drafter's training loop, and its commands
    evaluate          acceptance on held-out prompts, counted by SpecDecodeStats.observe_draft;
                      AcceptanceProbe measures it cheaply while a drafter trains
    live              a notebook-sized run: small fresh data, train_drafter, acceptance as it learns
    common            the frozen target's helpers, lr schedule, clock, progress bar, logs
    cli               the command line (``__main__`` runs it)

Each stage writes its checkpoint atomically and a JSON training log next to it
(``training_log.json``: loss curve, throughput, wall time, device, final
numbers). ``dflash_lab.viz.plot_training_log`` draws a log. Nothing here
imports a plotting or serving library: it runs on a bare GPU box with torch,
transformers, tokenizers, safetensors, numpy and tqdm.

The stronger pair (one H200, torch 2.11, transformers 5.17; ``scripts/train_pair_h200.sh`` runs
steps 2-4 in one sitting, about 9 device-minutes):

    python -m dflash_lab.train corpus --out .data/code.jsonl.xz            # CPU [~2 min]
    python -m dflash_lab.train target --corpus .data/code.jsonl.xz --epochs 3 --time-budget 150
    python -m dflash_lab.train distill --corpus .data/code.jsonl.xz --data distill.safetensors \
        --num-sequences 400000 --gen-batch 8192 --time-budget 80 \
        --prefix-sources distill=0.25,train=0.25,distill_stdlib=0.25,train_stdlib=0.25
    python -m dflash_lab.train drafter --data distill.safetensors --attention paper --layers 4 \
        --batch-size 256 --lr 2e-3 --warmup 200 --steps 100000 --short-block-share 0.3 \
        --eval-prompts 0 --time-budget 250 --out checkpoints/laguna-tiny-code-dflash
    python -m dflash_lab.train drafter ... --attention poolside --out checkpoints/laguna-tiny-code-dflash-poolside
        # the two drafters ran side by side on the GPU, same data, same time budget
    python -m dflash_lab.train evaluate --drafter ... --update-log      # CPU, float32

The time budgets only cap the step counts (the logs record what ran); pass
``--steps`` without a budget to fix them.
"""

from .cli import main
from .common import LOG_NAME, freeze, greedy_generate, write_log
from .distill import DistillConfig, build_distill_data, is_degenerate, load_distill_data, save_distill_data
from .drafter_config import ATTENTION_PRESETS, DrafterTrainConfig, check_attention, make_drafter_config
from .drafter_training import reshape_drafter, train_drafter
from .evaluate import AcceptanceProbe, evaluate_acceptance, load_pair_for_eval, replay_greedy_decoding
from .objective import (TargetFeatureCache, block_inputs, dflash_loss, draft_logits_for, gather_positions,
                        label_positions, position_weights, sample_anchors, short_block_mask, target_soft_labels)
from .target_lm import TargetTrainConfig, corpus_streams, train_target
from .tokenizer import EOS_ID, MASK_ID, SPECIAL_TOKENS, save_tokenizer, train_tokenizer
