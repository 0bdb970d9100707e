"""Train the lab's tiny Laguna code model and its DFlash drafter.

    python -m dflash_lab.train tokenizer   # CPU, ~1 min: byte-level BPE + the held-out prompt set
    python -m dflash_lab.train target      # GPU: LagunaForCausalLM on the stdlib's train split
    python -m dflash_lab.train drafter     # GPU: self-distillation data + DFlash drafter

Each stage writes its checkpoint atomically and a JSON training log next to it
(``training_log.json``: loss curve, throughput, wall time, device, final
numbers). ``dflash_lab.viz.plot_training_log`` draws a log.

The drafter recipe, in one paragraph. The test distribution of a drafter is
the target's own greedy continuation of prompts the target has never seen. So
the training data is exactly that: prefixes cut from files the target did not
train on (the ``distill`` split, see ``corpus.py``) and from its train split,
continued greedily by the frozen target in large batches with a KV cache.
Every training sequence then yields many DFlash blocks: at each sampled
anchor position p the block is [x_p, MASK x (B-1)], the drafter's context is
the target's aux hidden states of positions < p, and block position j is
trained towards the target's distribution at position p+j-1 (the prediction
of token p+j), with a loss weight exp(-(j-1)/gamma) that decays along the
block, because a draft token only counts if every token before it was
accepted.

This module imports no plotting or serving library: it runs on a bare GPU box
with torch, transformers, tokenizers, safetensors, numpy and tqdm.

How the shipped pair was made (one H200, torch 2.11, transformers 5.17,
Python 3.12's standard library as the corpus; wall times in brackets):

    python -m dflash_lab.train tokenizer                    # CPU [40 s]
    python -m dflash_lab.train target --time-budget 175     # 287 steps, 4 epochs [24 s training, 41 s in all]
    python -m dflash_lab.train drafter --steps 20000 --num-sequences 300000 --gen-batch 8192 \
        --gen-fraction 0.3 --eval-prompts 24 --time-budget 370
        # 289k self-distilled sequences [152 s], 3689 steps [242 s]
    python -m dflash_lab.train drafter --init checkpoints/laguna-tiny-code-dflash --short-block-share 0.5 \
        --lr 1e-3 --warmup 50 --seed 1 --steps 20000 --num-sequences 150000 --gen-batch 8192 \
        --gen-fraction 0.3 --eval-prompts 0 --time-budget 235
        # fresh data [73 s], 1799 more steps with short blocks mixed in [121 s]
    python -m dflash_lab.train evaluate --update-log         # CPU [90 s]

The time budgets only cap the step counts (the logs record what ran); pass
``--steps`` without a budget to fix them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import corpus

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"
TARGET_DIR = CHECKPOINTS / "laguna-tiny-code"
DRAFTER_DIR = CHECKPOINTS / "laguna-tiny-code-dflash"
PROMPTS_FILE = CHECKPOINTS / "heldout_prompts.json"
LOG_NAME = "training_log.json"

# The tokenizer's special tokens, in id order: the tiny target's config names
# pad=0, bos=1, eos=2, and DFlash's mask token is 3.
PAD, BOS, EOS, MASK = "<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK]
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(4)


# ---------------------------------------------------------------------------
# Shared plumbing: seeds, devices, schedules, logs
# ---------------------------------------------------------------------------


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info["device_name"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class Clock:
    """Wall time since start, and how much of a time budget is left."""

    def __init__(self, budget_s: float | None = None):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()


PACE_FROM, PACE_TO = 10, 30  # steps between which the pace is measured (after warm-up effects)


def synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def fit_steps(planned: int, done: int, seconds_per_step: float, seconds_left: float) -> int:
    """How many steps fit: the planned number, or fewer if the time budget says so."""
    if not math.isfinite(seconds_left):
        return planned
    return max(done + 1, min(planned, done + int(seconds_left / max(seconds_per_step, 1e-6))))


def write_json(path, obj) -> None:
    """Write JSON atomically (a temporary sibling, then rename)."""
    from .checkpoint import atomic_file

    text = json.dumps(obj, indent=1) + "\n"
    atomic_file(path, lambda tmp: tmp.write_text(text))


def progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, mininterval=5.0, dynamic_ncols=True)


# ---------------------------------------------------------------------------
# Stage 1: tokenizer (byte-level BPE) and the held-out prompt set
# ---------------------------------------------------------------------------


def train_tokenizer(texts, vocab_size: int = 4096):
    """A byte-level BPE (GPT-2 style pre-tokenisation) with our four specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID, MASK_ID]
    return tok


def save_tokenizer(tok, out_dir) -> None:
    """tokenizer.json + tokenizer_config.json, loadable by transformers' AutoTokenizer offline."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, mask_token=MASK,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # Name the class every transformers version knows (v5 writes its internal backend name).
    cfg_file = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    write_json(cfg_file, cfg)


def load_tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path} (run `python -m dflash_lab.train tokenizer`)")
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def cmd_tokenizer(args) -> None:
    clock = Clock()
    files = corpus.gather(args.corpus)
    prompts = corpus.cut_prompts(files, n=args.num_prompts, seed=args.seed)
    corpus.save_prompts(prompts, args.prompts)
    train_files = corpus.drop_files_containing(corpus.by_split(files)["train"], prompts)
    tok = train_tokenizer((f.text for f in train_files), args.vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out)
    sample = "".join(f.text for f in train_files[:50])
    n_tok = len(tok.encode(sample).ids)
    prompt_lens = [len(tok.encode(p["text"]).ids) for p in prompts]
    print(f"tokenizer: {tok.get_vocab_size()} tokens, {len(sample) / n_tok:.2f} chars/token on train text; "
          f"{len(prompts)} held-out prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens -> {args.prompts}; "
          f"{clock.elapsed():.0f}s")


# ---------------------------------------------------------------------------
# Token streams
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
    """Token streams of the three splits. Train and distill drop any file holding a held-out prompt."""
    splits = corpus.by_split(corpus.gather(corpus_root))
    for name in ("train", "distill"):
        splits[name] = corpus.drop_files_containing(splits[name], prompts)
    return {name: token_stream(tokenizer, files) for name, files in splits.items()}


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens from a 1-D token stream."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen).to(stream.device)
    return stream[starts[:, None] + torch.arange(length, device=stream.device)].long()  # (B, length)


# ---------------------------------------------------------------------------
# Stage 2: the target
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


def ensure_experts_implementation(model, example: torch.Tensor, *, backward: bool) -> str:
    """Use transformers' grouped-GEMM MoE where this torch supports it, else the per-expert loop."""
    try:
        with torch.autocast(example.device.type, dtype=torch.bfloat16, enabled=backward and example.device.type == "cuda"):
            out = model(input_ids=example)
        if backward:
            out.logits.float().mean().backward()
            model.zero_grad(set_to_none=True)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        print(f"grouped-GEMM experts unavailable here ({type(e).__name__}: {str(e)[:120]}); using the eager loop")
        model.set_experts_implementation("eager")
    return model.config._experts_implementation


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


def train_target(vocab_size: int, streams: dict, cfg: TargetTrainConfig, device: torch.device, *,
                 time_budget: float | None = None, config_overrides: dict | None = None):
    """Train a tiny LagunaForCausalLM; return (model with the best held-out state, log dict)."""
    from .target import build_target, tiny_laguna_config

    clock = Clock(time_budget)
    gen = seed_everything(cfg.seed)
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
    log = {"stage": "target", "config": asdict(cfg), "model_config": model_cfg.to_dict(), **device_info(device),
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
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.perf_counter() - loop_start
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
    log.update(steps=step, planned_steps=planned, tokens_seen=step * tokens_per_step,
               epochs_seen=step * tokens_per_step / train.numel(), train_seconds=train_time,
               throughput_tokens_per_s=step * tokens_per_step / train_time, final=final)
    return model, log


def sample_text(model, tokenizer, prompt: str, n: int = 64) -> str:
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
    return tokenizer.decode(greedy_generate(model, ids, n)[0, ids.shape[1]:].tolist())


def cmd_target(args) -> None:
    clock = Clock(args.time_budget)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = corpus.load_prompts(args.prompts)
    streams = corpus_streams(tokenizer, args.corpus, prompts)
    print({k: v.size for k, v in streams.items()}, f"tokens; {clock.elapsed():.0f}s")
    cfg = TargetTrainConfig(epochs=args.epochs, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            seed=args.seed)
    model, log = train_target(len(tokenizer), streams, cfg, device, time_budget=clock.left() - 15 if args.time_budget else None)
    log["wall_seconds"] = clock.elapsed()
    log["samples"] = [{"prompt": p["text"][-200:], "continuation": sample_text(model, tokenizer, p["text"])}
                      for p in prompts[:3]]
    tok_dir = Path(args.tokenizer)
    tok_files = {name: (tok_dir / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")
                 if (tok_dir / name).is_file()}

    def write(tmp: Path):
        model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        for name, data in tok_files.items():
            (tmp / name).write_bytes(data)
        write_json(tmp / LOG_NAME, log)

    from .checkpoint import atomic_directory

    atomic_directory(args.out, write)
    f = log["final"]
    print(f"target: {log['steps']} steps ({log['epochs_seen']:.2f} epochs) in {log['train_seconds']:.0f}s, "
          f"{log['throughput_tokens_per_s'] / 1e3:.0f}k tok/s; held-out loss {f['heldout_loss']:.3f} "
          f"(ppl {f['heldout_perplexity']:.1f}), distill {f['distill_loss']:.3f}, train {f['train_loss']:.3f}")
    for s in log["samples"]:
        print("---- prompt end:", repr(s["prompt"][-80:]), "\n---- greedy:", repr(s["continuation"]))


# ---------------------------------------------------------------------------
# Greedy generation and target features
# ---------------------------------------------------------------------------


@torch.no_grad()
def greedy_generate(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts ids (B, P) by n tokens, with a KV cache."""
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(n - 1):
        out = target(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([ids, torch.stack(tokens, 1)], dim=1)  # (B, P + n)


def target_features(target, ids: torch.Tensor, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux hidden states (B, T, n_aux * H), final-normed hidden (B, T, H)) without the full logits."""
    layers = target.model.layers
    captured = {}
    hooks = [layers[i].register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i in layer_ids]
    try:
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1), hidden


# ---------------------------------------------------------------------------
# Stage 3a: self-distillation data
# ---------------------------------------------------------------------------


def newline_token_ids(tokenizer) -> torch.Tensor:
    """Ids of tokens whose text starts with a line break (cutting before one ends a prefix at a line end)."""
    ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).startswith("\n")]
    return torch.tensor(ids, dtype=torch.long)


def cut_points(stream: np.ndarray, newline_ids: torch.Tensor, min_prefix: int) -> np.ndarray:
    """Positions e where stream[e] starts a new line: a prefix stream[e-P:e] ends at a line end."""
    is_nl = np.isin(stream, newline_ids.numpy())
    e = np.nonzero(is_nl)[0]
    return e[e >= min_prefix]


def is_degenerate(continuations: torch.Tensor, min_distinct: int = 8) -> torch.Tensor:
    """(N,) True where a continuation (N, C) uses fewer than min_distinct distinct tokens ("-192-192-...")."""
    s = continuations.sort(dim=1).values
    distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(1)
    return distinct < min_distinct


@dataclass
class DistillConfig:
    prefix_lengths: tuple = (64, 96, 128, 160, 192, 224, 256, 288)  # spans the held-out prompts' lengths
    continuation: int = 96  # the test generates 64 tokens; the last anchor needs block_size more
    num_sequences: int = 200_000
    gen_batch: int = 4096
    distill_share: float = 0.5  # fraction of prefixes from files the target never saw
    min_distinct: int = 8
    seed: int = 1


@torch.no_grad()
def build_distill_data(target, tokenizer, streams: dict, cfg: DistillConfig, *, time_budget: float | None = None):
    """Greedy continuations of real prefixes: {P: uint16 (n, P + continuation)} and stats.

    Generation runs in float32 on bf16-rounded weights, the same arithmetic as
    the CPU evaluation, so labels are the target's greedy tokens as users see them.
    """
    clock = Clock(time_budget)
    device = next(target.parameters()).device
    rng = np.random.default_rng(cfg.seed)
    nl = newline_token_ids(tokenizer)
    pools = {name: (streams[name], cut_points(streams[name], nl, max(cfg.prefix_lengths)))
             for name in ("distill", "train")}
    data: dict[int, list[torch.Tensor]] = {p: [] for p in cfg.prefix_lengths}
    made = dropped = batches = 0
    bar = progress(cfg.num_sequences, "self-distillation data")
    max_batches = 3 * math.ceil(cfg.num_sequences / cfg.gen_batch) + 2  # in case most come out degenerate
    while made < cfg.num_sequences and clock.left() > 0 and batches < max_batches:
        P = cfg.prefix_lengths[batches % len(cfg.prefix_lengths)]
        n_distill = int(round(cfg.gen_batch * cfg.distill_share))
        prefixes = []
        for name, n in (("distill", n_distill), ("train", cfg.gen_batch - n_distill)):
            stream, ends = pools[name]
            e = rng.choice(ends, size=n)
            prefixes.append(stream[e[:, None] - P + np.arange(P)])
        ids = torch.from_numpy(np.concatenate(prefixes).astype(np.int64)).to(device)
        seqs = greedy_generate(target, ids, cfg.continuation)
        bad = is_degenerate(seqs[:, P:], cfg.min_distinct)
        keep = seqs[~bad]
        data[P].append(keep.to(torch.int32).cpu())
        made += keep.shape[0]
        dropped += int(bad.sum())
        batches += 1
        bar.update(keep.shape[0])
    bar.close()
    data = {P: torch.cat(v).numpy().astype(np.uint16) for P, v in data.items() if v}
    stats = {"sequences": made, "dropped_degenerate": dropped, "batches": batches,
             "continuation": cfg.continuation, "seconds": clock.elapsed(),
             "tokens_generated": (made + dropped) * cfg.continuation}
    return data, stats


def save_distill_data(data: dict, path) -> None:
    from safetensors.numpy import save_file

    from .checkpoint import atomic_file

    atomic_file(path, lambda tmp: save_file({f"prefix_{P}": v for P, v in data.items()}, str(tmp)))


def load_distill_data(path) -> dict:
    from safetensors.numpy import load_file

    return {int(k.removeprefix("prefix_")): v for k, v in load_file(str(path)).items()}


# ---------------------------------------------------------------------------
# Stage 3b: the DFlash drafter
# ---------------------------------------------------------------------------


def sample_anchors(batch: int, lo: int, hi: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """(B, num) sorted distinct anchor positions in [lo, hi], per sequence."""
    scores = torch.rand(batch, hi - lo + 1, generator=gen)
    return scores.topk(min(num, hi - lo + 1), dim=1).indices.sort(dim=1).values + lo


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """DFlash blocks: [x_p, MASK x (B-1)] at positions p..p+B-1 for every anchor p.

    ids (B, T), anchors (B, A) -> block ids (B, A*bs) and positions (B, A*bs).
    """
    offsets = torch.arange(block_size, device=ids.device)
    positions = anchors[..., None] + offsets  # (B, A, bs)
    block = torch.full_like(positions, mask_token_id)
    block[..., 0] = ids.gather(1, anchors)
    return block.flatten(1), positions.flatten(1)


def label_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, A, bs-1): block position j >= 1 learns the target's prediction made AT position p+j-1."""
    return anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)


def gather_positions(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, T, D), pos (B, ...) -> (B, ..., D)."""
    B, D = x.shape[0], x.shape[-1]
    flat = x.gather(1, pos.reshape(B, -1, 1).expand(-1, -1, D))
    return flat.view(*pos.shape, D)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(j-1)/gamma) for block positions j = 1..bs-1."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def dflash_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, weights: torch.Tensor):
    """Soft cross-entropy to the target's distribution, weighted by block position.

    draft_logits, target_logits: (..., bs-1, V); weights: (bs-1,) or (..., bs-1), zero
    where a block is shorter. Returns (loss, per-position top-1 agreement (bs-1,)).
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    p = F.softmax(target_logits.float(), dim=-1)
    ce = -(p * logq).sum(-1)  # (..., bs-1)
    weights = weights.expand_as(ce)
    loss = (ce * weights).sum() / weights.sum()
    agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    counted = (weights > 0).float().reshape(-1, ce.shape[-1])
    return loss, (agree.reshape(-1, ce.shape[-1]) * counted).sum(0) / counted.sum(0).clamp(min=1)


def short_block_mask(mask: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Shrink each block of a (B, Q, N+Q) DFlash mask to its first ``lengths`` (B, A) slots.

    Slots past a block's length are hidden as keys, so the slots before them
    compute exactly what a real block of that length computes: one layout
    trains every block size up to block_size at once.
    """
    B, A = lengths.shape
    slot = torch.arange(block_size, device=lengths.device)
    in_block = (slot < lengths[..., None]).flatten(1)  # (B, A*bs)
    n_ctx = mask.shape[-1] - A * block_size
    keys = torch.cat([in_block.new_ones(B, n_ctx), in_block], dim=1)  # (B, N+Q)
    return mask & keys[:, None, :]


def draft_logits_for(target, drafter, ids: torch.Tensor, anchors: torch.Tensor, aux: torch.Tensor, block_size: int,
                     lengths: torch.Tensor | None = None):
    """The drafter's logits for every block: (B, A, bs, V). Context: all of ids, masked per block.

    lengths (B, A), optional: each block's own length (<= block_size), see short_block_mask.
    """
    from .drafter import dflash_attention_mask

    B, T = ids.shape
    ctx = drafter.combine_hidden_states(aux).reshape(B * T, -1)  # (B*T, H)
    positions = torch.arange(T, device=ids.device)
    k, v = drafter.precompute_context_kv(ctx, positions.repeat(B), path="reference")  # (L, B*T, nkv, hd)
    k, v = k.unflatten(1, (B, T)), v.unflatten(1, (B, T))  # (L, B, T, nkv, hd)
    block, block_pos = block_inputs(ids, anchors, block_size, drafter.config.mask_token_id)
    noise = target.model.embed_tokens(block)  # (B, A*bs, H)
    mask = None
    if lengths is not None:
        mask = short_block_mask(dflash_attention_mask(block_pos, positions, block_size, drafter.config.window),
                                lengths, block_size)
    hidden = drafter(noise, block_pos, k, v, positions, block_size=block_size, mask=mask)
    return target.lm_head(hidden).unflatten(1, (anchors.shape[1], block_size))  # (B, A, bs, V)


@dataclass
class DrafterTrainConfig:
    num_layers: int = 3  # deeper drafts further; 3 layers of hidden 256 keep the pair under 25 MB
    intermediate_size: int = 768
    num_aux_layers: int = 4  # target layers the drafter reads, spread over the target's depth
    block_size: int = 16
    anchors_per_seq: int = 32
    batch_size: int = 128
    steps: int = 4000
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0  # position-weight decay (the DFlash paper's value for block 16)
    short_block_share: float = 0.0  # share of blocks cut to a random length 2..bs-1, so smaller blocks work too
    log_every: int = 20
    seed: int = 0


def make_drafter_config(target_config, cfg: DrafterTrainConfig):
    from .config import DFlashDrafterConfig
    from .target import target_layer_ids_spread

    n = cfg.num_layers
    return DFlashDrafterConfig(
        hidden_size=target_config.hidden_size, num_hidden_layers=n,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.head_dim, intermediate_size=cfg.intermediate_size, layer_types=["full_attention"] * n,
        draft_vocab_size=target_config.vocab_size,
        target_layer_ids=target_layer_ids_spread(target_config.num_hidden_layers, cfg.num_aux_layers),
        mask_token_id=MASK_ID, block_size=cfg.block_size, target_hidden_size=target_config.hidden_size,
        target_layer_count=target_config.num_hidden_layers, rms_norm_eps=target_config.rms_norm_eps,
        # Mask tokens differ only by position: rotate every channel, with a short-range theta.
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
        max_position_embeddings=target_config.max_position_embeddings,
    )


def freeze(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def train_drafter(target, data: dict, cfg: DrafterTrainConfig, continuation: int, *, time_budget: float | None = None,
                  init=None):
    """Train a DFlashLagunaDrafter on self-distilled sequences; return (drafter, log).

    init: a drafter to continue training (its config wins over cfg's shape fields).
    """
    from .drafter import DFlashLagunaDrafter

    clock = Clock(time_budget)
    device = next(target.parameters()).device
    gen = seed_everything(cfg.seed)
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
    groups = [(P, torch.from_numpy(v.astype(np.int32)).to(device)) for P, v in sorted(data.items())]
    sizes = torch.tensor([g[1].shape[0] for g in groups], dtype=torch.float)
    bs, autocast = cfg.block_size, device.type == "cuda"
    weights = position_weights(bs, cfg.gamma, device)
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    log = {"stage": "drafter", "config": asdict(cfg), "drafter_config": dcfg.to_dict(), **device_info(device),
           "initialised_from": getattr(init, "source", None) if init is not None else None,
           "num_parameters": sum(p.numel() for p in drafter.parameters()),
           "train_sequences": int(sizes.sum()), "loss_curve": [], "accuracy_curve": [], "eval_curve": []}
    total = cfg.steps
    bar = progress(total, "drafter")
    loop_start, step, seqs_seen, pace = time.perf_counter(), 0, 0, []
    while step < total:
        lr = lr_at(step, total, cfg.lr, cfg.warmup, floor=0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        P, pool = groups[int(torch.multinomial(sizes, 1, generator=gen))]
        rows = torch.randint(0, pool.shape[0], (cfg.batch_size,), generator=gen).to(device)
        ids = pool[rows].long()  # (B, P + continuation)
        anchors = sample_anchors(cfg.batch_size, P, P + continuation - bs, cfg.anchors_per_seq, gen).to(device)
        with torch.no_grad():
            aux, last = target_features(target, ids, layer_ids)
            target_logits = target.lm_head(gather_positions(last, label_positions(anchors, bs)))  # (B, A, bs-1, V)
        lengths, w = None, weights
        if cfg.short_block_share > 0:
            short = torch.rand(anchors.shape, generator=gen) < cfg.short_block_share
            lengths = torch.where(short, torch.randint(2, bs, anchors.shape, generator=gen), bs).to(device)
            w = weights * (torch.arange(1, bs, device=device) < lengths[..., None])  # (B, A, bs-1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = draft_logits_for(target, drafter, ids, anchors, aux, bs, lengths)[:, :, 1:]
        loss, agree = dflash_loss(logits, target_logits, w)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seqs_seen += cfg.batch_size
        if step in (PACE_FROM, PACE_TO):
            pace.append(synchronized_time(device))
            if step == PACE_TO:
                per_step = (pace[1] - pace[0]) / (PACE_TO - PACE_FROM) * 1.03
                total = fit_steps(cfg.steps, step, per_step, clock.left())
                bar.total = total
        if step % cfg.log_every == 0 or step == total:
            log["loss_curve"].append([step, round(loss.item(), 4), lr])
            log["accuracy_curve"].append([step, [round(a, 4) for a in agree.tolist()]])
            bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{agree[0].item():.2f}")
        bar.update(1)
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.perf_counter() - loop_start
    log.update(steps=step, planned_steps=cfg.steps, sequences_seen=seqs_seen,
               blocks_seen=seqs_seen * cfg.anchors_per_seq, train_seconds=train_time,
               throughput_blocks_per_s=seqs_seen * cfg.anchors_per_seq / train_time,
               epochs_seen=seqs_seen / max(1, int(sizes.sum())))
    return drafter.eval(), log


# ---------------------------------------------------------------------------
# Evaluation: acceptance on held-out prompts, teacher-forced
# ---------------------------------------------------------------------------
#
# With greedy verification, speculative decoding reproduces the target's greedy
# continuation g exactly, and the drafter's context at a block starting at p is
# the target's features of g[:p], whatever path led there. So one target pass
# over prompt + g and one drafter pass with a block at EVERY position p give
# every draft the decoder could ever make; replaying the accept/bonus walk over
# them gives the decoder's counters exactly (up to arithmetic-order ties).


@torch.no_grad()
def drafts_at_every_anchor(target, drafter, seq: torch.Tensor, prompt_len: int, num_anchors: int, block_size: int):
    """(num_anchors, bs-1) greedy drafts of blocks anchored at prompt_len .. prompt_len+num_anchors-1."""
    aux, _ = target_features(target, seq[None], drafter.config.target_layer_ids)
    anchors = torch.arange(prompt_len, prompt_len + num_anchors, device=seq.device)[None]
    logits = draft_logits_for(target, drafter, seq[None], anchors, aux, block_size)
    return logits[0, :, 1:].argmax(-1)


def replay_greedy_decoding(greedy: torch.Tensor, drafts: torch.Tensor, prompt_len: int, max_new_tokens: int) -> dict:
    """Walk draft -> verify -> accept over precomputed drafts; vLLM's counters.

    greedy: prompt + the target's greedy continuation (>= prompt_len + max_new_tokens + bs).
    drafts[a]: the draft of the block anchored at prompt_len + a.
    """
    k = drafts.shape[1]
    per_pos = [0] * k
    num_drafts = accepted = 0
    p = prompt_len  # the prefill produced token prompt_len; the first block starts there
    while p - prompt_len + 1 < max_new_tokens:
        truth = greedy[p + 1: p + 1 + k]
        match = (drafts[p - prompt_len] == truth).long()
        a = int(match.cumprod(0).sum())
        num_drafts += 1
        accepted += a
        for i in range(a):
            per_pos[i] += 1
        p += a + 1
    return {"num_drafts": num_drafts, "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos}


def evaluate_acceptance(target, drafter, tokenizer, prompts: list[dict], *, block_sizes=(16,),
                        max_new_tokens: int = 64, show_progress: bool = False) -> dict[int, dict]:
    """Mean acceptance length and per-position rates of greedy DFlash decoding on held-out prompts.

    One entry per block size. Each also holds the teacher-forced per-position
    rates over EVERY anchor (a smoother estimate that does not depend on where
    blocks happen to start).
    """
    device = next(target.parameters()).device
    longest = max(block_sizes)
    results = {}
    for bs in block_sizes:
        results[bs] = {"num_drafts": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [0] * (bs - 1),
                       "all_anchor": torch.zeros(bs - 1, dtype=torch.float64)}
    it = prompts
    if show_progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc="acceptance")
    for pr in it:
        ids = torch.tensor([tokenizer.encode(pr["text"], add_special_tokens=False)], device=device)
        P = ids.shape[1]
        g = greedy_generate(target, ids, max_new_tokens + longest)[0]
        for bs, acc in results.items():
            k = bs - 1
            drafts = drafts_at_every_anchor(target, drafter, g, P, max_new_tokens, bs)
            r = replay_greedy_decoding(g, drafts, P, max_new_tokens)
            acc["num_drafts"] += r["num_drafts"]
            acc["num_accepted_tokens"] += r["num_accepted_tokens"]
            acc["num_accepted_tokens_per_pos"] = [a + b for a, b in zip(acc["num_accepted_tokens_per_pos"], r["num_accepted_tokens_per_pos"])]
            truth = torch.stack([g[P + a + 1: P + a + 1 + k] for a in range(max_new_tokens)])
            acc["all_anchor"] += (drafts == truth).long().cumprod(1).sum(0).double().cpu()
    out = {}
    for bs, acc in results.items():
        nd = max(1, acc["num_drafts"])
        every = (acc.pop("all_anchor") / (max_new_tokens * len(prompts))).tolist()
        out[bs] = {
            "block_size": bs, "max_new_tokens": max_new_tokens, "num_prompts": len(prompts), **acc,
            "mean_acceptance_length": 1 + acc["num_accepted_tokens"] / nd,
            "per_position_acceptance_rate": [c / nd for c in acc["num_accepted_tokens_per_pos"]],
            "every_anchor_rate": every, "every_anchor_mean_acceptance_length": 1 + sum(every),
        }
    return out


def load_pair_for_eval(target_dir, drafter_dir, device):
    """Target and drafter as shipped (bf16 weights), computed in float32."""
    from .checkpoint import load_drafter
    from .target import load_target

    target = freeze(load_target(target_dir, device=device, dtype=torch.float32))
    drafter = freeze(load_drafter(drafter_dir, device=device, dtype=torch.float32))
    return target, drafter


def cmd_drafter(args) -> None:
    from .checkpoint import save_drafter
    from .target import load_target

    clock = Clock(args.time_budget)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.target)
    prompts = corpus.load_prompts(args.prompts)
    # The target as it ships: bf16 weights, float32 arithmetic (what every user runs on a CPU).
    target = freeze(load_target(args.target, device=device, dtype=torch.float32))
    ensure_experts_implementation(target, torch.zeros(2, 8, dtype=torch.long, device=device), backward=False)
    dist_cfg = DistillConfig(num_sequences=args.num_sequences, continuation=args.continuation,
                             gen_batch=args.gen_batch, min_distinct=args.min_distinct, seed=args.seed + 1)
    if args.data and Path(args.data).is_file():
        data = load_distill_data(args.data)
        data_stats = {"loaded_from": str(args.data), "sequences": int(sum(v.shape[0] for v in data.values()))}
    else:
        streams = corpus_streams(tokenizer, args.corpus, prompts)
        gen_budget = None if args.time_budget is None else args.gen_fraction * clock.left()
        data, data_stats = build_distill_data(target, tokenizer, streams, dist_cfg, time_budget=gen_budget)
        del streams
        if args.data:
            save_distill_data(data, args.data)
    print(f"self-distillation data: {data_stats}; {clock.elapsed():.0f}s")
    cfg = DrafterTrainConfig(num_layers=args.layers, block_size=args.block_size, steps=args.steps,
                             batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                             short_block_share=args.short_block_share, seed=args.seed)
    init = None
    if args.init:
        from .checkpoint import load_drafter

        init = load_drafter(args.init, device=device, dtype=torch.float32)
        init.source = str(args.init)
    blocks = [int(b) for b in args.eval_blocks.split(",")]
    reserve = args.eval_prompts * (0.6 + 0.15 * len(blocks)) + 15  # evaluation and saving
    budget = None if args.time_budget is None else clock.left() - reserve
    drafter, log = train_drafter(target, data, cfg, dist_cfg.continuation, time_budget=budget, init=init)
    log["data"] = {**data_stats, "config": asdict(dist_cfg)}
    if init is not None:  # keep the first run's log: it is part of how this drafter came to be
        previous = Path(args.init) / LOG_NAME
        if previous.is_file():
            log["previous_run"] = json.loads(previous.read_text())
    save_drafter(drafter, args.out, dtype=torch.bfloat16)
    write_json(Path(args.out) / LOG_NAME, log)
    print(f"drafter: {log['steps']} steps in {log['train_seconds']:.0f}s "
          f"({log['throughput_blocks_per_s']:.0f} blocks/s, {log['epochs_seen']:.2f} passes over the data); "
          f"last acc {log['accuracy_curve'][-1][1][:4]}")
    if args.eval_prompts:
        del data
        t, d = load_pair_for_eval(args.target, args.out, device)
        evs = evaluate_acceptance(t, d, tokenizer, prompts[: args.eval_prompts], block_sizes=blocks)
        log["final"] = {**{f"block_{bs}": ev for bs, ev in evs.items()}, "eval_device": str(device)}
        for ev in evs.values():
            print_acceptance(ev)
    log["wall_seconds"] = clock.elapsed()
    write_json(Path(args.out) / LOG_NAME, log)


def cmd_evaluate(args) -> None:
    """Acceptance of a target/drafter pair on the held-out prompts (teacher-forced replay)."""
    clock = Clock()
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.target)
    prompts = corpus.load_prompts(args.prompts)[: args.eval_prompts]
    target, drafter = load_pair_for_eval(args.target, args.drafter, device)
    blocks = [int(b) for b in args.eval_blocks.split(",")]
    evs = evaluate_acceptance(target, drafter, tokenizer, prompts, block_sizes=blocks, show_progress=True)
    for ev in evs.values():
        print_acceptance(ev)
    print(f"{clock.elapsed():.0f}s on {device}")
    if args.update_log:
        path = Path(args.drafter) / LOG_NAME
        log = json.loads(path.read_text())
        log.setdefault("final", {})
        log["final"].update({f"block_{bs}": ev for bs, ev in evs.items()}, eval_device=str(device))
        write_json(path, log)


def print_acceptance(ev: dict) -> None:
    rates = " ".join(f"{r:.2f}" for r in ev["per_position_acceptance_rate"])
    print(f"block {ev['block_size']}: mean acceptance length {ev['mean_acceptance_length']:.3f} over "
          f"{ev['num_drafts']} drafts ({ev['num_prompts']} prompts); every-anchor estimate "
          f"{ev['every_anchor_mean_acceptance_length']:.3f}\n  per-position acceptance: {rates}")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash_lab.train", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--corpus", default=None, help="corpus root (default: this interpreter's stdlib)")
        sp.add_argument("--prompts", default=str(PROMPTS_FILE), help="held-out prompt JSON")
        sp.add_argument("--device", default=None, help="default: cuda if available, else cpu")
        sp.add_argument("--time-budget", type=float, default=None, help="seconds for the whole command")

    sp = sub.add_parser("tokenizer", help="train the BPE tokenizer and cut the held-out prompts (CPU)")
    common(sp)
    sp.add_argument("--out", default=str(TARGET_DIR))
    sp.add_argument("--vocab-size", type=int, default=4096)
    sp.add_argument("--num-prompts", type=int, default=corpus.NUM_PROMPTS)
    sp.set_defaults(func=cmd_tokenizer)

    sp = sub.add_parser("target", help="train the tiny Laguna target")
    common(sp)
    sp.add_argument("--tokenizer", default=str(TARGET_DIR))
    sp.add_argument("--out", default=str(TARGET_DIR))
    sp.add_argument("--epochs", type=float, default=TargetTrainConfig.epochs)
    sp.add_argument("--batch-size", type=int, default=TargetTrainConfig.batch_size)
    sp.add_argument("--seq-len", type=int, default=TargetTrainConfig.seq_len)
    sp.add_argument("--lr", type=float, default=TargetTrainConfig.lr)
    sp.set_defaults(func=cmd_target)

    sp = sub.add_parser("drafter", help="generate self-distillation data and train the DFlash drafter")
    common(sp)
    sp.add_argument("--target", default=str(TARGET_DIR))
    sp.add_argument("--out", default=str(DRAFTER_DIR))
    sp.add_argument("--layers", type=int, default=DrafterTrainConfig.num_layers)
    sp.add_argument("--block-size", type=int, default=DrafterTrainConfig.block_size)
    sp.add_argument("--steps", type=int, default=DrafterTrainConfig.steps)
    sp.add_argument("--batch-size", type=int, default=DrafterTrainConfig.batch_size)
    sp.add_argument("--lr", type=float, default=DrafterTrainConfig.lr)
    sp.add_argument("--warmup", type=int, default=DrafterTrainConfig.warmup)
    sp.add_argument("--short-block-share", type=float, default=DrafterTrainConfig.short_block_share,
                    help="share of blocks trained at a random shorter length (serves smaller block sizes)")
    sp.add_argument("--init", default=None, help="continue training this drafter checkpoint")
    sp.add_argument("--num-sequences", type=int, default=DistillConfig.num_sequences)
    sp.add_argument("--continuation", type=int, default=DistillConfig.continuation)
    sp.add_argument("--gen-batch", type=int, default=DistillConfig.gen_batch)
    sp.add_argument("--min-distinct", type=int, default=DistillConfig.min_distinct,
                    help="drop continuations with fewer distinct tokens (degenerate repetition)")
    sp.add_argument("--gen-fraction", type=float, default=0.25, help="share of the time budget for data generation")
    sp.add_argument("--data", default=None, help="self-distillation data file (.safetensors): read if present, else written")
    sp.add_argument("--eval-prompts", type=int, default=corpus.NUM_PROMPTS, help="held-out prompts to evaluate on (0: none)")
    sp.add_argument("--eval-blocks", default="16", help="comma-separated block sizes to evaluate")
    sp.set_defaults(func=cmd_drafter)

    sp = sub.add_parser("evaluate", help="acceptance of a target/drafter pair on the held-out prompts")
    common(sp)
    sp.add_argument("--target", default=str(TARGET_DIR))
    sp.add_argument("--drafter", default=str(DRAFTER_DIR))
    sp.add_argument("--eval-prompts", type=int, default=corpus.NUM_PROMPTS)
    sp.add_argument("--eval-blocks", default="16,8,4")
    sp.add_argument("--update-log", action="store_true", help="write the numbers into the drafter's training log")
    sp.set_defaults(func=cmd_evaluate)

    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args.func(args)


if __name__ == "__main__":
    main()
