"""Stage 3b: train the DFlash drafter on self-distilled sequences, then evaluate it.

The loop samples a prefix-length group, a batch of sequences and anchors in
their continuation window, runs the frozen target once for aux hidden states
and soft labels, and the drafter once for every block (``objective.py``). What a run
trains, and how, is its ``DrafterTrainConfig`` (``drafter_config.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from .. import corpus
from ..checkpoint import load_drafter, save_drafter
from ..drafter import DFlashLagunaDrafter
from ..runtime import load_tokenizer, resolve_device, seed_everything, synchronized_time
from ..target import load_target
from .common import (LOG_NAME, PACE_FROM, PACE_TO, REFIT_EVERY, Clock, ensure_experts_implementation, fit_steps,
                     freeze, lr_at, progress, run_info, write_log)
from .distill import DistillConfig, build_distill_data, load_distill_data, load_distill_stats, save_distill_data
from .drafter_config import DrafterTrainConfig, make_drafter_config
from .evaluate import evaluate_acceptance, load_pair_for_eval, print_acceptance
from .objective import (TargetFeatureCache, draft_logits_for, dflash_loss, position_weights, sample_anchors,
                        sample_block_lengths, short_block_weights, target_soft_labels)
from .target_lm import corpus_streams


def reshape_drafter(drafter: DFlashLagunaDrafter, *, num_layers: int | None = None,
                    intermediate_size: int | None = None, seed: int = 0) -> DFlashLagunaDrafter:
    """A warm start of another shape: the first ``num_layers`` layers, MLPs widened to ``intermediate_size``.

    Dropping layers keeps the bottom of the stack (the layers nearest the target's features). Widening
    adds MLP units whose gate/up rows start as a fresh drafter's and whose down-projection columns
    start at zero, so the widened drafter computes exactly what the original did until training moves
    it. Narrowing an MLP is refused: it would throw away trained units silently.
    """
    old = drafter.config
    n = old.num_hidden_layers if num_layers is None else int(num_layers)
    width = old.intermediate_size if intermediate_size is None else int(intermediate_size)
    if not 1 <= n <= old.num_hidden_layers:
        raise ValueError(f"num_layers must be 1..{old.num_hidden_layers} (the initial drafter's depth), got {n}")
    if width < old.intermediate_size:
        raise ValueError(f"intermediate_size {width} is narrower than the initial drafter's "
                         f"{old.intermediate_size}: widening only")
    cfg = replace(old, num_hidden_layers=n, layer_types=old.layer_types[:n], intermediate_size=width, source=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new = DFlashLagunaDrafter(cfg)
    device = next(drafter.parameters()).device
    new = new.to(device=device, dtype=next(drafter.parameters()).dtype)
    old_state, state = drafter.state_dict(), new.state_dict()
    w0 = old.intermediate_size
    for name, value in state.items():
        if name.startswith("layers.") and int(name.split(".")[1]) >= n:
            continue
        src = old_state[name]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            value[:w0].copy_(src)  # extra rows keep the fresh initialisation
        elif name.endswith("mlp.down_proj.weight"):
            value.zero_()
            value[:, :w0].copy_(src)  # extra columns start at zero: the output is unchanged
        else:
            value.copy_(src)
    new.load_state_dict(state)
    new.source = getattr(drafter, "source", None)
    return new


def trainable_parameters(drafter, train_only=()) -> list:
    """The parameters training moves: those named with a prefix in ``train_only`` (all if it is empty).
    The others are frozen (``requires_grad`` off): gradients still flow through them to the trained ones."""
    prefixes = tuple(train_only)
    named = list(drafter.named_parameters())
    unknown = [p for p in prefixes if not any(n.startswith(p) for n, _ in named)]
    if unknown:
        raise ValueError(f"`train_only` prefixes {unknown} name no parameter of the drafter")
    trained = [p for n, p in named if not prefixes or n.startswith(prefixes)]
    for n, p in named:
        p.requires_grad_(not prefixes or n.startswith(prefixes))
    return trained


def train_drafter(target, data: dict, cfg: DrafterTrainConfig, continuation: int, *, time_budget: float | None = None,
                  init=None, callback=None, show_progress: bool = True):
    """Train a DFlashLagunaDrafter on self-distilled sequences; return (drafter, log).

    init: a drafter to continue training (its config wins over cfg's shape fields).
    callback(step, drafter, log): called after every ``log_every`` steps (a live figure, an
    evaluation); the drafter is in training mode and gets it back that way.
    """
    clock = Clock(time_budget)
    device = next(target.parameters()).device
    precision = torch.get_float32_matmul_precision()
    # The frozen float32 target's forward is most of a step: TF32 tensor cores make it several times
    # faster, and its soft labels and features move by ~1e-3, far below the drafter's own bf16 noise.
    torch.set_float32_matmul_precision("high")
    try:
        return _train_drafter(target, data, cfg, continuation, clock, device, init, callback, show_progress)
    finally:
        torch.set_float32_matmul_precision(precision)


def _train_drafter(target, data, cfg, continuation, clock, device, init, callback, show_progress):
    # training keeps torch's fastest kernels, as the shipped run did
    gen = seed_everything(cfg.seed, deterministic=False)
    if init is not None:
        drafter = init.to(device=device, dtype=torch.float32).train()
        for p in drafter.parameters():
            p.requires_grad_(True)
        dcfg = drafter.config
        if dcfg.block_size != cfg.block_size:
            raise ValueError(f"the initial drafter was built for block size {dcfg.block_size}, not {cfg.block_size}")
    else:
        dcfg = make_drafter_config(target.config, cfg)
        drafter = DFlashLagunaDrafter(dcfg).to(device).train()
    layer_ids = dcfg.target_layer_ids
    if not any(v.shape[0] for v in data.values()):
        raise ValueError("no self-distillation sequences to train on (were they all degenerate? see --min-distinct)")
    groups = [(P, torch.from_numpy(v.astype(np.int32)).to(device)) for P, v in sorted(data.items()) if v.shape[0]]
    caches = [TargetFeatureCache(target, pool, layer_ids) if cfg.cache_target_features else None for _, pool in groups]
    sizes = torch.tensor([g[1].shape[0] for g in groups], dtype=torch.float)
    bs, autocast = cfg.block_size, device.type == "cuda"
    weights = position_weights(bs, cfg.gamma, device)
    trained = trainable_parameters(drafter, cfg.train_only)
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    log = {"stage": "drafter", "config": asdict(cfg), "drafter_config": dcfg.to_dict(), **run_info(device),
           "initialised_from": getattr(init, "source", None) if init is not None else None,
           "num_parameters": sum(p.numel() for p in drafter.parameters()),
           "trained_parameters": sum(p.numel() for p in trained),
           "train_sequences": int(sizes.sum()), "loss_curve": [], "accuracy_curve": [], "eval_curve": []}
    total = cfg.steps
    bar = progress(total, "drafter", disable=not show_progress)
    loop_start, step, seqs_seen, pace_start = time.perf_counter(), 0, 0, None
    while step < total:
        lr = lr_at(step, total, cfg.lr, cfg.warmup, floor=cfg.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        group = int(torch.multinomial(sizes, 1, generator=gen))
        (P, pool), cache = groups[group], caches[group]
        rows = torch.randint(0, pool.shape[0], (cfg.batch_size,), generator=gen).to(device)
        ids = pool[rows].long()  # (B, P + continuation)
        anchors = sample_anchors(cfg.batch_size, P, P + continuation - bs, cfg.anchors_per_seq, gen).to(device)
        if cache is None:
            aux, target_logits = target_soft_labels(target, ids, anchors, layer_ids, bs)  # (B, T, n*H), (B, A, bs-1, V)
        else:
            aux, target_logits = cache.soft_labels(target, rows, anchors, bs)
        lengths, w = None, weights
        if cfg.short_block_share > 0:
            lengths = sample_block_lengths(anchors.shape, bs, cfg.short_block_share, gen).to(device)  # (B, A)
            w = short_block_weights(weights, lengths)  # (B, A, bs-1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = draft_logits_for(target, drafter, ids, anchors, aux, bs, lengths)[:, :, 1:]
        loss, agree = dflash_loss(logits, target_logits, w)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seqs_seen += cfg.batch_size
        if step == PACE_FROM:
            pace_start = synchronized_time(device)
        elif step >= PACE_TO and (step == PACE_TO or step % REFIT_EVERY == 0) and clock.budget_s is not None:
            # Fit the step count (and so the lr schedule) to the time left; refit as the pace drifts
            # (another job on the same GPU, evaluation callbacks).
            per_step = (synchronized_time(device) - pace_start) / (step - PACE_FROM) * 1.03
            total = fit_steps(cfg.steps, step, per_step, clock.left())
            bar.total = total
        if step % cfg.log_every == 0 or step == total:
            log["loss_curve"].append([step, round(loss.item(), 4), lr])
            log["accuracy_curve"].append([step, [round(a, 4) for a in agree.tolist()]])
            bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{agree[0].item():.2f}")
            if callback is not None:
                callback(step, drafter, log)
                drafter.train()
        bar.update(1)
    bar.close()
    train_time = synchronized_time(device) - loop_start
    log.update(steps=step, planned_steps=cfg.steps, sequences_seen=seqs_seen,
               blocks_seen=seqs_seen * cfg.anchors_per_seq, train_seconds=train_time,
               throughput_blocks_per_s=seqs_seen * cfg.anchors_per_seq / train_time,
               epochs_seen=seqs_seen / max(1, int(sizes.sum())))
    return drafter.eval(), log


def distill_config(args) -> DistillConfig:
    sources = None
    if args.prefix_sources:
        try:
            sources = {k.strip(): float(v) for k, v in (pair.split("=") for pair in args.prefix_sources.split(","))}
        except ValueError:
            raise ValueError(f"--prefix-sources must look like distill=0.5,train=0.5, "
                             f"got {args.prefix_sources!r}") from None
    return DistillConfig(num_sequences=args.num_sequences, continuation=args.continuation, gen_batch=args.gen_batch,
                         min_distinct=args.min_distinct, seed=args.seed + 1, sources=sources)


def load_frozen_target(path, device):
    """The target as it ships: bf16 weights, float32 arithmetic (what every user runs on a CPU)."""
    target = freeze(load_target(path, device=device, dtype=torch.float32))
    ensure_experts_implementation(target, torch.zeros(2, 8, dtype=torch.long, device=device), backward=False)
    return target


def make_distill_data(args, target, tokenizer, prompts, time_budget):
    """Fresh self-distillation data (saved to ``args.data`` when given): (data, stats)."""
    streams = corpus_streams(tokenizer, args.corpus, prompts)
    data, stats = build_distill_data(target, tokenizer, streams, distill_config(args), time_budget=time_budget)
    if args.data:
        save_distill_data(data, args.data, stats)
    return data, stats


def run_distill(args) -> None:
    """`python -m dflash_lab.train distill`: only the self-distillation data, into ``--data`` (shared by drafters)."""
    clock = Clock(args.time_budget)
    device = resolve_device(args.device, caller="train distill")
    target = load_frozen_target(args.target, device)
    _, stats = make_distill_data(args, target, load_tokenizer(args.target), corpus.load_prompts(args.prompts),
                                 args.time_budget)
    print(f"self-distillation data -> {args.data}: {stats}; {clock.elapsed():.0f}s")


def run_drafter(args) -> None:
    """`python -m dflash_lab.train drafter`: self-distillation data, training, the checkpoint, evaluation."""
    clock = Clock(args.time_budget)
    cfg = args.train_config  # cli.train_config_from_args: built and checked before minutes of data generation
    device = resolve_device(args.device, caller="train drafter")
    tokenizer = load_tokenizer(args.target)
    prompts = corpus.load_prompts(args.prompts)
    target = load_frozen_target(args.target, device)
    if args.data and Path(args.data).is_file():
        data = load_distill_data(args.data)
        data_stats = {"loaded_from": str(args.data), **load_distill_stats(args.data)}
    else:
        gen_budget = None if args.time_budget is None else args.gen_fraction * clock.left()
        data, data_stats = make_distill_data(args, target, tokenizer, prompts, gen_budget)
    print(f"self-distillation data: {data_stats}; {clock.elapsed():.0f}s")
    init = None
    if args.init:
        init = load_drafter(args.init, device=device, dtype=torch.float32)
        init.source = str(args.init)
        if args.layers is not None or args.intermediate_size is not None:
            init = reshape_drafter(init, num_layers=args.layers, intermediate_size=args.intermediate_size,
                                   seed=args.seed)
            print(f"initial drafter reshaped to {init.config.num_hidden_layers} layers, "
                  f"MLP width {init.config.intermediate_size}")
    blocks = [int(b) for b in args.eval_blocks.split(",")]
    reserve = args.eval_prompts * (0.6 + 0.15 * len(blocks)) + 15  # evaluation and saving
    budget = None if args.time_budget is None else clock.left() - reserve
    continuation = {v.shape[1] - P for P, v in data.items()}.pop()  # sequences are (n, P + continuation)
    drafter, log = train_drafter(target, data, cfg, continuation, time_budget=budget, init=init)
    log["data"] = data_stats
    if init is not None:  # keep the first run's log: it is part of how this drafter came to be
        previous = Path(args.init) / LOG_NAME
        if previous.is_file():
            log["previous_run"] = json.loads(previous.read_text())
    save_drafter(drafter, args.out, dtype=torch.bfloat16)
    write_log(Path(args.out) / LOG_NAME, log)
    print(f"drafter: {log['steps']} steps in {log['train_seconds']:.0f}s "
          f"({log['throughput_blocks_per_s']:.0f} blocks/s, {log['epochs_seen']:.2f} passes over the data); "
          f"last acc {log['accuracy_curve'][-1][1][:4]}")
    if args.eval_prompts:
        del data
        t, d = load_pair_for_eval(args.target, args.out, device)
        evs = evaluate_acceptance(t, d, tokenizer, prompts[: args.eval_prompts], block_sizes=blocks)
        log["final"] = {**{f"block_{bs}": ev.record() for bs, ev in evs.items()}, "eval_device": str(device)}
        for ev in evs.values():
            print_acceptance(ev)
    log["wall_seconds"] = clock.elapsed()
    write_log(Path(args.out) / LOG_NAME, log)
