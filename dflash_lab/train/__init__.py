"""Train the lab's tiny Laguna code model and its DFlash drafter.

    python -m dflash_lab.train tokenizer   # CPU, ~1 min: byte-level BPE + the held-out prompt set
    python -m dflash_lab.train target      # GPU: LagunaForCausalLM on the stdlib's train split
    python -m dflash_lab.train drafter     # GPU: self-distillation data + DFlash drafter
    python -m dflash_lab.train evaluate    # acceptance of a pair on the held-out prompts

One file per stage, in the order the recipe runs them:

    tokenizer         stage 1: byte-level BPE with the four specials first, and saving it
    target_lm         stage 2: corpus token streams, fixed windows, training the target
    distill           stage 3a: self-distillation data (the target's greedy continuations)
    objective         the DFlash objective: anchors, blocks, soft labels, position-weighted
                      loss, short-block masks
    drafter_training  stage 3b: the drafter's training loop and the `drafter` command
    evaluate          acceptance on held-out prompts, counted by SpecDecodeStats.observe_draft
    common            the frozen target's helpers, lr schedule, clock, progress bar, logs
    cli               the command line (``__main__`` runs it)

Each stage writes its checkpoint atomically and a JSON training log next to it
(``training_log.json``: loss curve, throughput, wall time, device, final
numbers). ``dflash_lab.viz.plot_training_log`` draws a log. Nothing here
imports a plotting or serving library: it runs on a bare GPU box with torch,
transformers, tokenizers, safetensors, numpy and tqdm.

How the shipped pair was made (one H200, torch 2.11, transformers 5.17,
Python 3.12's standard library as the corpus; wall times in brackets):

    python -m dflash_lab.train tokenizer                    # CPU [40 s]
    python -m dflash_lab.train target --time-budget 175     # 287 steps, 4 epochs [24 s training, 41 s in all]
    python -m dflash_lab.train drafter --steps 20000 --num-sequences 300000 --gen-batch 8192 \\
        --gen-fraction 0.3 --eval-prompts 24 --time-budget 370
        # 289k self-distilled sequences [152 s], 3689 steps [242 s]
    python -m dflash_lab.train drafter --init checkpoints/laguna-tiny-code-dflash --short-block-share 0.5 \\
        --lr 1e-3 --warmup 50 --seed 1 --steps 20000 --num-sequences 150000 --gen-batch 8192 \\
        --gen-fraction 0.3 --eval-prompts 0 --time-budget 235
        # fresh data [73 s], 1799 more steps with short blocks mixed in [121 s]
    python -m dflash_lab.train evaluate --update-log         # CPU [90 s]

The time budgets only cap the step counts (the logs record what ran); pass
``--steps`` without a budget to fix them.
"""

from .cli import main
from .common import LOG_NAME, freeze, greedy_generate, write_log
from .distill import DistillConfig, build_distill_data, is_degenerate, load_distill_data, save_distill_data
from .drafter_training import DrafterTrainConfig, make_drafter_config, train_drafter
from .evaluate import evaluate_acceptance, load_pair_for_eval, replay_greedy_decoding
from .objective import (block_inputs, dflash_loss, draft_logits_for, gather_positions, label_positions,
                        position_weights, sample_anchors, short_block_mask, target_soft_labels)
from .target_lm import TargetTrainConfig, corpus_streams, train_target
from .tokenizer import EOS_ID, MASK_ID, SPECIAL_TOKENS, save_tokenizer, train_tokenizer
