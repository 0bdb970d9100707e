"""Distil a drafter in a notebook: small fresh data, the CLI's training loop, acceptance as it learns.

The same three pieces as ``python -m dflash_lab.train drafter``, sized for one sitting:

    prefix_streams      token streams of stdlib files the target never trained on
                        (the corpus's ``distill`` split) to cut prefixes from
    build_distill_data  the target's greedy continuations of those prefixes (distill.py)
    train_drafter       the DFlash objective and loop (drafter_training.py), with a
                        callback that measures held-out acceptance every few steps
                        (``AcceptanceProbe``) and hands each measurement to the caller

``train_live`` returns a ``LiveRun``: the drafter, the CLI's training log and the
acceptance history, which ``dflash_lab.viz.training_live`` draws while it grows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from .. import corpus
from ..drafter import DFlashLagunaDrafter
from ..spec_decode import SpecDecodeStats
from .distill import DistillConfig, build_distill_data
from .drafter_config import DEFAULT_PRESET, DrafterTrainConfig, make_drafter_config
from .drafter_training import train_drafter
from .evaluate import AcceptanceProbe
from .target_lm import token_stream


def prefix_streams(tokenizer, *, split: str = "distill", max_files: int | None = 200, corpus_root=None) -> dict:
    """{"distill": tokens, "train": the same tokens} of up to ``max_files`` library files of one split.

    The default split, ``distill``, holds files the shipped target never trained on, so the
    drafter learns how the target continues code it has not memorised (as on held-out prompts).
    """
    files = [f for f in corpus.gather(corpus_root) if f.split == split and not corpus.is_test_path(f.relpath)]
    if not files:
        raise ValueError(f"no non-test files of split {split!r} under {corpus_root or corpus.stdlib_dir()}")
    stream = token_stream(tokenizer, files[:max_files])
    return {"distill": stream, "train": stream}


def distill_small(target, tokenizer, *, num_sequences: int, prefix_lengths=(64,), continuation: int = 48,
                  gen_batch: int | None = None, seed: int = 1, max_files: int | None = 200):
    """Fresh self-distillation data for a notebook run: ({P: (n, P + continuation)}, stats).

    Prefixes are continued ``gen_batch`` at a time (default ``num_sequences``) until at least
    ``num_sequences`` continuations are kept; degenerate ones (``distill.is_degenerate``) are
    dropped and counted in ``stats["dropped_degenerate"]``. A ``gen_batch`` a little above
    ``num_sequences`` makes one batch enough.
    """
    cfg = DistillConfig(prefix_lengths=tuple(prefix_lengths), continuation=continuation, num_sequences=num_sequences,
                        gen_batch=gen_batch or num_sequences, distill_share=1.0, seed=seed)
    streams = prefix_streams(tokenizer, max_files=max_files)
    return build_distill_data(target, tokenizer, streams, cfg, show_progress=False)


# The drafter's reader of the target: ``combine_hidden_states`` (a norm per target layer, ``fc``, a norm).
READER = ("aux_hidden_norms", "fc", "hidden_norm")


def with_fresh_reader(drafter: DFlashLagunaDrafter, *, block_size: int | None = None, seed: int = 0):
    """A copy of ``drafter`` whose reader of the target (``READER``) starts from random numbers.

    Everything else (the decoder layers and the final norm) is copied, so the copy still knows
    how to draft code, but reads the target's features through a random ``fc``: training it
    teaches it to read its target. ``block_size``: the copy's (default the drafter's own).
    The initialisation is a fresh drafter's (``reset_parameters``), seeded with ``seed``.
    """
    cfg = replace(drafter.config, block_size=block_size or drafter.config.block_size)
    torch.manual_seed(seed)
    fresh = DFlashLagunaDrafter(cfg)
    kept = {k: v for k, v in drafter.state_dict().items() if not k.startswith(READER)}
    missing, unexpected = fresh.load_state_dict(kept, strict=False)
    assert not unexpected and all(k.startswith(READER) for k in missing), (missing, unexpected)
    fresh = fresh.to(device=next(drafter.parameters()).device, dtype=torch.float32)
    fresh.window = drafter.window
    fresh.source = f"{getattr(drafter, 'source', 'a drafter')} with a fresh reader ({', '.join(READER)})"
    return fresh.eval()


@dataclass
class LiveRun:
    """A drafter in training: its log (the CLI's) and held-out acceptance every ``eval_every`` steps."""

    config: DrafterTrainConfig
    evals: list = field(default_factory=list)  # [(step, SpecDecodeStats)], step 0 = before training
    log: dict = field(default_factory=dict)
    drafter: object = None
    initial: object = None  # the untrained drafter it started from (same seed), for before/after comparisons

    @property
    def before(self) -> SpecDecodeStats:
        return self.evals[0][1]

    @property
    def after(self) -> SpecDecodeStats:
        return self.evals[-1][1]


def drafter_train_config(*, steps: int, attention: str = DEFAULT_PRESET, **overrides) -> DrafterTrainConfig:
    """A DrafterTrainConfig for a notebook run: ``DrafterTrainConfig.from_preset(attention, steps=steps,
    **overrides)``, the merge and the defaults of ``python -m dflash_lab.train drafter`` (3 layers, block 16,
    200 warm-up steps: a run of a few hundred steps passes a shorter ``warmup``). ``attention`` names an
    ATTENTION_PRESETS entry ("paper": full attention, non-causal; "poolside": sliding window 64, causal)."""
    return DrafterTrainConfig.from_preset(attention, steps=steps, **overrides)


def train_live(target, data: dict, cfg: DrafterTrainConfig, probe: AcceptanceProbe, *, eval_every: int,
               on_update=None, show_progress: bool = True, init=None) -> LiveRun:
    """Train with ``train_drafter``; measure ``probe`` before and every ``eval_every`` steps.

    on_update(run): called after every logged step and every measurement (redraw a figure).
    ``eval_every`` is a multiple of ``cfg.log_every`` (the loop hands out the drafter at logged steps).
    init: a drafter to start from instead of a fresh one (``train_drafter``'s ``init``; it is
    copied, so the caller's drafter is left as it is, and ``run.initial`` is that copy untrained).
    """
    if eval_every < 1 or eval_every % cfg.log_every:
        raise ValueError(f"`eval_every` ({eval_every}) must be a positive multiple of log_every ({cfg.log_every})")
    run = LiveRun(cfg)
    # Step 0: the drafter train_drafter starts from (same seed, same initialisation), untrained.
    device = next(target.parameters()).device
    if init is None:
        torch.manual_seed(cfg.seed)
        run.initial = DFlashLagunaDrafter(make_drafter_config(target.config, cfg)).to(device).eval()
    else:
        run.initial = copy.deepcopy(init).to(device=device, dtype=torch.float32).eval()
    run.evals.append((0, probe(run.initial)))
    continuation = {v.shape[1] - P for P, v in data.items()}.pop()

    def callback(step, drafter, log):
        run.log, run.drafter = log, drafter
        if step % eval_every == 0 and step < cfg.steps:
            run.evals.append((step, probe(drafter)))
        if on_update is not None:
            on_update(run)

    start = None if init is None else copy.deepcopy(run.initial)
    run.drafter, run.log = train_drafter(target, data, cfg, continuation, init=start, callback=callback,
                                         show_progress=show_progress)
    # The last measurement after the loop: in the arithmetic the trained drafter is served with
    # (train_drafter lets float32 matmuls use TF32 on a GPU while it runs).
    run.evals.append((run.log["steps"], probe(run.drafter)))
    run.log["eval_curve"] = [[s, st.mean_acceptance_length] for s, st in run.evals]
    if on_update is not None:
        on_update(run)
    return run
