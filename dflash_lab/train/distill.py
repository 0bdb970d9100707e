"""Stage 3a: self-distillation data, the target's own greedy continuations.

The test distribution of a drafter is the target's greedy continuation of
prompts it has never seen, so the training data is exactly that: prefixes cut
at line ends from files the target did not train on (the ``distill`` split)
and from its train split, continued greedily by the frozen target in large
batches with a KV cache. Degenerate continuations ("-192-192-...") are dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import safetensors
import safetensors.numpy  # called as safetensors.numpy.save_file, so a test can make it fail
import torch

from ..runtime import atomic_file
from .common import Clock, greedy_generate, progress


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
    sources: dict | None = None  # {corpus stream: share of prefixes}; None: distill_share of "distill", rest "train"
    min_distinct: int = 8
    seed: int = 1


@torch.no_grad()
def build_distill_data(target, tokenizer, streams: dict, cfg: DistillConfig, *, time_budget: float | None = None,
                       show_progress: bool = True):
    """Greedy continuations of real prefixes: {P: uint16 (n, P + continuation)} and stats.

    Generation runs in float32 on bf16-rounded weights, the same arithmetic as
    the CPU evaluation, so labels are the target's greedy tokens as users see them.
    """
    clock = Clock(time_budget)
    device = next(target.parameters()).device
    rng = np.random.default_rng(cfg.seed)
    nl = newline_token_ids(tokenizer)
    shares = cfg.sources or {"distill": cfg.distill_share, "train": 1 - cfg.distill_share}
    missing = sorted(set(shares) - set(streams))
    if missing:
        raise ValueError(f"prefix sources {missing} are not corpus streams (have {sorted(streams)})")
    pools = {name: (streams[name], cut_points(streams[name], nl, max(cfg.prefix_lengths))) for name in shares}
    counts = np.floor(np.cumsum([0.0] + [shares[k] / sum(shares.values()) for k in shares]) * cfg.gen_batch + 0.5)
    per_batch = dict(zip(shares, np.diff(counts).astype(int)))  # prefixes per source in every batch
    data: dict[int, list[torch.Tensor]] = {p: [] for p in cfg.prefix_lengths}
    made = dropped = batches = 0
    bar = progress(cfg.num_sequences, "self-distillation data", disable=not show_progress)
    max_batches = 3 * math.ceil(cfg.num_sequences / cfg.gen_batch) + 2  # in case most come out degenerate
    while made < cfg.num_sequences and clock.left() > 0 and batches < max_batches:
        P = cfg.prefix_lengths[batches % len(cfg.prefix_lengths)]
        prefixes = []
        for name, n in per_batch.items():
            stream, ends = pools[name]
            e = rng.choice(ends, size=n)
            prefixes.append(stream[e[:, None] - P + np.arange(P)])  # (n, P)
        ids = torch.from_numpy(np.concatenate(prefixes).astype(np.int64)).to(device)
        seqs = greedy_generate(target, ids, cfg.continuation)  # (gen_batch, P + continuation)
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
             "tokens_generated": (made + dropped) * cfg.continuation, "config": asdict(cfg)}
    return data, stats


def save_distill_data(data: dict, path, stats: dict | None = None) -> None:
    """{P: uint16 (n, P + continuation)} as one safetensors file (tensors ``prefix_P``), atomically;
    ``stats`` (how it was made) rides along in the file's metadata."""
    metadata = {"stats": json.dumps(stats)} if stats is not None else None
    atomic_file(path, lambda tmp: safetensors.numpy.save_file({f"prefix_{P}": v for P, v in data.items()}, str(tmp),
                                                              metadata=metadata))


def load_distill_data(path) -> dict:
    """What save_distill_data wrote: {P: uint16 (n, P + continuation)}."""
    return {int(k.removeprefix("prefix_")): v for k, v in safetensors.numpy.load_file(str(path)).items()}


def load_distill_stats(path) -> dict:
    """The stats save_distill_data stored with the data ({} if none)."""
    with safetensors.safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    return json.loads(meta["stats"]) if "stats" in meta else {}
