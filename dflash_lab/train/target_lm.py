"""Stage 2: the target, a tiny LagunaForCausalLM trained on a corpus's train split.

The corpus is the stdlib (a directory) or a corpus pack of the stdlib and installed
packages (``code_corpus``, stage 0).

Token streams of the corpus splits, random training windows, fixed evaluation
windows, and the training loop that keeps the state with the lowest held-out loss.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import corpus
from ..runtime import atomic_directory, atomic_file, load_tokenizer, resolve_device, seed_everything, synchronized_time
from ..target import build_target, tiny_laguna_config
from . import code_corpus
from .common import (LOG_NAME, PACE_FROM, PACE_TO, Clock, ensure_experts_implementation, fit_steps, greedy_generate,
                     lr_at, progress, run_info, write_log)
from .tokenizer import EOS_ID

# ---------------------------------------------------------------------------
# Token streams and windows
# ---------------------------------------------------------------------------


def token_stream(tokenizer, files) -> np.ndarray:
    """All files' tokens, each followed by EOS, as one uint16 array (files in sorted-path order)."""
    enc = tokenizer.backend_tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([EOS_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def corpus_streams(tokenizer, corpus_root, prompts) -> dict[str, np.ndarray]:
    """Token streams of the three splits, and of their stdlib files alone (``heldout_stdlib``, ...).
    Train and distill drop any file holding a held-out prompt, or repeating three lines of one.

    corpus_root: a directory of ``.py`` files (default: the stdlib), or a corpus pack
    (``code_corpus.save_corpus_pack``), whose tokens are cached beside it.
    """
    if code_corpus.is_corpus_pack(corpus_root):
        cache = Path(str(corpus_root) + f".tokens-{tokenizer_fingerprint(tokenizer)}.npz")
        if cache.is_file():
            with np.load(cache) as z:
                return {k: z[k] for k in z.files}
        files, packages = code_corpus.load_corpus_pack(corpus_root)
        stdlib = {f.relpath for f, p in zip(files, packages) if p == code_corpus.STDLIB_PACKAGE}
    else:
        cache, files = None, corpus.gather(corpus_root)
        stdlib = {f.relpath for f in files}
    splits = corpus.by_split(files)
    for name in ("train", "distill"):
        splits[name] = code_corpus.drop_prompt_overlap(corpus.drop_files_containing(splits[name], prompts), prompts)
    # The held-out prompts come from the stdlib: its files alone give the comparable perplexity, and
    # self-distillation can draw prefixes from them (DistillConfig.sources).
    for name in ("heldout", "distill", "train"):
        splits[f"{name}_stdlib"] = [f for f in splits[name] if f.relpath in stdlib]
    streams = {name: token_stream(tokenizer, files) for name, files in splits.items()}
    if cache is not None:
        def write(tmp):
            with open(tmp, "wb") as fh:
                np.savez(fh, **streams)

        atomic_file(cache, write)
    return streams


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary and merges (token caches are only valid for one)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:12]


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens from a 1-D token stream."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen).to(stream.device)
    return stream[starts[:, None] + torch.arange(length, device=stream.device)].long()  # (B, length)


def fixed_windows(stream: np.ndarray, length: int, limit: int | None, device) -> torch.Tensor:
    """Non-overlapping windows spread evenly over a stream (deterministic evaluation sets).

    All windows when limit is None; otherwise ``limit`` of them, evenly spaced,
    so a probe does not depend on which files happen to sort first.
    """
    available = stream.size // length
    windows = torch.from_numpy(stream[: available * length].astype(np.int64)).view(available, length)
    if limit is not None and limit < available:
        windows = windows[torch.linspace(0, available - 1, limit).long()]
    return windows.to(device)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclass
class TargetTrainConfig:
    epochs: float = 4.0  # passes over the train split; few, so the target generalises instead of memorising
    batch_size: int = 64
    seq_len: int = 512  # longer than any held-out prompt + continuation, so no test position is unseen
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100  # held-out loss on a fixed sample; the best state is the one we keep
    eval_windows: int = 128
    log_every: int = 10
    seed: int = 0


@torch.no_grad()
def lm_loss(model, windows: torch.Tensor, batch_size: int, autocast: bool) -> float:
    """Mean next-token cross-entropy over windows (B, T)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i:i + batch_size]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count if count else math.nan


def train_target(vocab_size: int, streams: dict, cfg: TargetTrainConfig, device: torch.device, *,
                 time_budget: float | None = None, config_overrides: dict | None = None):
    """Train a tiny LagunaForCausalLM; return (model with the best held-out state, log dict)."""
    clock = Clock(time_budget)
    # training keeps torch's fastest kernels, as the shipped run did
    gen = seed_everything(cfg.seed, deterministic=False)
    model_cfg = tiny_laguna_config(vocab_size, **(config_overrides or {}))
    model = build_target(model_cfg, seed=cfg.seed).to(device).train()
    autocast = device.type == "cuda"
    train = torch.from_numpy(streams["train"].astype(np.int32)).to(device)
    heldout = fixed_windows(streams["heldout"], cfg.seq_len, cfg.eval_windows, device)
    train_probe = fixed_windows(streams["train"], cfg.seq_len, cfg.eval_windows, device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    planned = max(1, int(cfg.epochs * train.numel() / tokens_per_step))
    experts = ensure_experts_implementation(model, train[: 2 * 64].long().view(2, 64), backward=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    log = {"stage": "target", "config": asdict(cfg), "model_config": model_cfg.to_dict(), **run_info(device),
           "experts_implementation": experts, "num_parameters": sum(p.numel() for p in model.parameters()),
           "train_tokens": int(train.numel()), "heldout_tokens": int(streams["heldout"].size),
           "distill_tokens": int(streams["distill"].size), "loss_curve": [], "eval_curve": []}
    best = (math.inf, None, -1)
    total = planned
    bar = progress(total, "target")
    loop_start, step, pace = time.perf_counter(), 0, []
    while step < total:
        lr = lr_at(step, total, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = random_windows(train, cfg.batch_size, cfg.seq_len, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step in (PACE_FROM, PACE_TO):  # measure the pace once, and shorten the run if the budget says so
            pace.append(synchronized_time(device))
            if step == PACE_TO:
                per_step = (pace[1] - pace[0]) / (PACE_TO - PACE_FROM) * 1.1  # + evaluation overhead
                total = fit_steps(planned, step, per_step, clock.left() - 25)
                bar.total = total
        if step % cfg.log_every == 0 or step == total:
            log["loss_curve"].append([step, round(out.loss.item(), 4), lr])
            bar.set_postfix(loss=f"{out.loss.item():.3f}")
        if step % cfg.eval_every == 0 or step == total:
            h = lm_loss(model, heldout, cfg.batch_size, autocast)
            log["eval_curve"].append([step, round(h, 4)])
            if h < best[0]:
                best = (h, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
        bar.update(1)
    bar.close()
    train_time = synchronized_time(device) - loop_start
    if best[1] is not None:  # the state with the lowest held-out loss
        model.load_state_dict(best[1])
    model.eval()
    # Final numbers on the bf16-rounded weights that ship, over ALL held-out tokens.
    model = model.to(torch.bfloat16).float()
    heldout_all = fixed_windows(streams["heldout"], cfg.seq_len, None, device)
    distill_all = fixed_windows(streams["distill"], cfg.seq_len, None, device)
    final = {"best_step": best[2], "heldout_loss": lm_loss(model, heldout_all, cfg.batch_size, False),
             "distill_loss": lm_loss(model, distill_all, cfg.batch_size, False),
             "train_loss": lm_loss(model, train_probe, cfg.batch_size, False)}
    final["heldout_perplexity"] = math.exp(final["heldout_loss"])
    if streams.get("heldout_stdlib") is not None and streams["heldout_stdlib"].size >= cfg.seq_len:
        # The stdlib's held-out files alone: where the held-out prompts come from.
        std = fixed_windows(streams["heldout_stdlib"], cfg.seq_len, None, device)
        final["heldout_stdlib_loss"] = lm_loss(model, std, cfg.batch_size, False)
        final["heldout_stdlib_perplexity"] = math.exp(final["heldout_stdlib_loss"])
    log.update(steps=step, planned_steps=planned, tokens_seen=step * tokens_per_step,
               epochs_seen=step * tokens_per_step / train.numel(), train_seconds=train_time,
               throughput_tokens_per_s=step * tokens_per_step / train_time, final=final)
    return model, log


def corpus_record(corpus_root, streams: dict) -> dict:
    """What the target read, for its log: tokens per split and, for a corpus pack, every package's licence."""
    record = {"source": str(corpus_root or corpus.stdlib_dir()), "tokens": {k: int(v.size) for k, v in streams.items()}}
    if code_corpus.is_corpus_pack(corpus_root):
        manifest = json.loads(code_corpus.manifest_path(corpus_root).read_text())
        record["packages"] = [[e["name"], e["version"], e["licence"], e["files"]] for e in manifest["packages"]]
        record["left_out"] = [[e["name"], e["licence"], e["why"]] for e in manifest["left_out"]]
    return record


def sample_text(model, tokenizer, prompt: str, n: int = 64) -> str:
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
    return tokenizer.decode(greedy_generate(model, ids, n)[0, ids.shape[1]:].tolist())


def run_target(args) -> None:
    """`python -m dflash_lab.train target`: token streams, training, then the checkpoint with its log."""
    clock = Clock(args.time_budget)
    device = resolve_device(args.device, caller="train target")
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = corpus.load_prompts(args.prompts)
    streams = corpus_streams(tokenizer, args.corpus, prompts)
    print({k: v.size for k, v in streams.items()}, f"tokens; {clock.elapsed():.0f}s")
    cfg = TargetTrainConfig(epochs=args.epochs, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            seed=args.seed)
    budget = clock.left() - 15 if args.time_budget else None
    model, log = train_target(len(tokenizer), streams, cfg, device, time_budget=budget)
    log["wall_seconds"] = clock.elapsed()
    log["corpus"] = corpus_record(args.corpus, streams)
    log["samples"] = [{"prompt": p["text"][-200:], "continuation": sample_text(model, tokenizer, p["text"])}
                      for p in prompts[:3]]
    tok_dir = Path(args.tokenizer)
    tok_files = {name: (tok_dir / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")
                 if (tok_dir / name).is_file()}

    def write(tmp: Path):
        model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        for name, data in tok_files.items():
            (tmp / name).write_bytes(data)
        write_log(tmp / LOG_NAME, log)

    atomic_directory(args.out, write)
    f = log["final"]
    print(f"target: {log['steps']} steps ({log['epochs_seen']:.2f} epochs) in {log['train_seconds']:.0f}s, "
          f"{log['throughput_tokens_per_s'] / 1e3:.0f}k tok/s; held-out loss {f['heldout_loss']:.3f} "
          f"(ppl {f['heldout_perplexity']:.1f}; "
          f"stdlib only: ppl {f.get('heldout_stdlib_perplexity', float('nan')):.1f}), "
          f"distill {f['distill_loss']:.3f}, train {f['train_loss']:.3f}")
    for s in log["samples"]:
        print("---- prompt end:", repr(s["prompt"][-80:]), "\n---- greedy:", repr(s["continuation"]))
