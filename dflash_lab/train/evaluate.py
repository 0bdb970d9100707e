"""Evaluation: acceptance of a target/drafter pair on held-out prompts, teacher-forced.

With greedy verification, speculative decoding reproduces the target's greedy
continuation g exactly, and the drafter's context at a block starting at p is
the target's features of g[:p], whatever path led there. So one target pass
over prompt + g and one drafter pass with a block at EVERY position p give
every draft the decoder could ever make; replaying the accept/bonus walk over
them with the decoder's own accept rule (``sampling.greedy_accept``), counted by its
own ``SpecDecodeStats.observe_draft``, gives the decoder's counters exactly (up to
arithmetic-order ties).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import corpus
from ..checkpoint import load_drafter
from ..config import DEFAULT_BLOCK_SIZE
from ..runtime import load_tokenizer, resolve_device
from ..spec_decode.proposers import require_dflash
from ..spec_decode.sampling import greedy_accept, greedy_accept_batch
from ..spec_decode.stats import SpecDecodeStats
from ..target import load_target, target_forward
from .common import LOG_NAME, Clock, freeze, greedy_generate, write_log
from .objective import draft_logits_for


@torch.no_grad()
def drafts_at_every_anchor(target, drafter, seq: torch.Tensor, prompt_len: int, num_anchors: int, block_size: int,
                           aux: torch.Tensor | None = None):
    """(num_anchors, bs-1) greedy drafts of blocks anchored at prompt_len .. prompt_len+num_anchors-1.

    aux (1, T, n_aux * H), optional: the target's features of seq for the drafter's layers, if already computed.
    """
    if aux is None:
        aux = target_forward(target, seq[None], drafter.config.target_layer_ids, use_cache=False,
                             with_logits=False).aux_hidden
    anchors = torch.arange(prompt_len, prompt_len + num_anchors, device=seq.device)[None]  # (1, A)
    logits = draft_logits_for(target, drafter, seq[None], anchors, aux, block_size)  # (1, A, bs, V)
    return logits[0, :, 1:].argmax(-1)


def replay_greedy_decoding(greedy: torch.Tensor, drafts: torch.Tensor, prompt_len: int, max_new_tokens: int,
                           stats: SpecDecodeStats | None = None) -> SpecDecodeStats:
    """Walk draft -> verify -> accept over precomputed drafts, counting into ``stats`` (a new one if None).

    greedy: prompt + the target's greedy continuation (>= prompt_len + max_new_tokens + bs).
    drafts[a]: the draft of the block anchored at prompt_len + a.
    """
    stats = SpecDecodeStats() if stats is None else stats
    k = drafts.shape[1]
    p = prompt_len  # the prefill produced token prompt_len; the first block starts there
    while p - prompt_len + 1 < max_new_tokens:
        accepted, _ = greedy_accept(drafts[p - prompt_len], greedy[p + 1: p + 2 + k])  # the target's argmax after p
        stats.observe_draft(k, accepted)
        p += accepted + 1  # the accepted tokens, then the target's bonus token
    return stats


@dataclass
class AcceptanceEval:
    """What ``evaluate_acceptance`` measured at one block size.

    stats: the decoder's counters (``SpecDecodeStats``, exactly what ``speculative_generate``
    would count on these prompts); every_anchor_rate: the teacher-forced per-position rates
    over EVERY anchor (a smoother estimate that does not depend on where blocks start).
    """

    block_size: int
    max_new_tokens: int
    num_prompts: int
    stats: SpecDecodeStats
    every_anchor_rate: list[float]
    per_prompt: list[SpecDecodeStats] = field(default_factory=list)  # the same counters, prompt by prompt

    def per_prompt_counts(self) -> list[list[int]]:
        """[drafts, accepted tokens] of each prompt: what a bootstrap over prompts resamples."""
        return [[s.num_drafts, s.num_accepted_tokens] for s in self.per_prompt]

    @property
    def every_anchor_mean_acceptance_length(self) -> float:
        return 1 + sum(self.every_anchor_rate)

    def record(self) -> dict:
        """For a training log: the settings, the counters and their rates (``SpecDecodeStats.from_dict`` reads it
        back)."""
        s = self.stats
        return {"block_size": self.block_size, "max_new_tokens": self.max_new_tokens, "num_prompts": self.num_prompts,
                "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(s.num_accepted_tokens_per_pos),
                "mean_acceptance_length": s.to_dict()["mean_acceptance_length"],
                "per_position_acceptance_rate": s.per_position_acceptance_rate,
                "every_anchor_rate": self.every_anchor_rate,
                "every_anchor_mean_acceptance_length": self.every_anchor_mean_acceptance_length,
                "per_prompt_drafts_accepted": self.per_prompt_counts()}


def evaluate_acceptance(target, drafter, tokenizer, prompts: list[dict], *, block_sizes=(DEFAULT_BLOCK_SIZE,),
                        max_new_tokens: int = 64, show_progress: bool = False) -> dict[int, AcceptanceEval]:
    """Acceptance of greedy DFlash decoding on held-out prompts, one ``AcceptanceEval`` per block size.

    A prompt is a dict with ``text`` (tokenized here) or ``input_ids`` (used as given).
    """
    require_dflash(drafter, "evaluate_acceptance")
    device = next(target.parameters()).device
    longest = max(block_sizes)
    per_prompt = {bs: [] for bs in block_sizes}
    every_anchor = {bs: torch.zeros(bs - 1, dtype=torch.float64) for bs in block_sizes}
    for pr in tqdm(prompts, desc="acceptance") if show_progress else prompts:
        ids = pr.get("input_ids") or tokenizer.encode(pr["text"], add_special_tokens=False)  # ids: e.g. a cut prompt
        ids = torch.tensor([ids], device=device)
        P = ids.shape[1]
        g = greedy_generate(target, ids, max_new_tokens + longest)[0]
        for bs in block_sizes:
            k = bs - 1
            drafts = drafts_at_every_anchor(target, drafter, g, P, max_new_tokens, bs)  # (max_new_tokens, k)
            per_prompt[bs].append(replay_greedy_decoding(
                g, drafts, P, max_new_tokens, SpecDecodeStats(num_accepted_tokens_per_pos=[0] * k)))
            # the target after each anchor
            argmax = torch.stack([g[P + a + 1: P + a + 2 + k] for a in range(max_new_tokens)])
            n, _ = greedy_accept_batch(drafts, argmax)  # every anchor's draft, verified as the decoder would
            every_anchor[bs] += (torch.arange(k, device=n.device) < n[:, None]).sum(0).double().cpu()
    return {bs: AcceptanceEval(bs, max_new_tokens, len(prompts),
                               sum(runs, SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (bs - 1))),
                               (every_anchor[bs] / (max_new_tokens * len(prompts))).tolist(), runs)
            for bs, runs in per_prompt.items()}


class AcceptanceProbe:
    """Held-out acceptance of any drafter of one frozen target, cheap enough to run while training.

    The target's greedy continuation of each prompt and its per-layer features are
    computed once; a call runs only the drafter (one forward per prompt) and replays
    greedy speculative decoding over its drafts, counted by ``SpecDecodeStats``
    exactly as ``evaluate_acceptance`` counts them.
    """

    @torch.no_grad()
    def __init__(self, target, prompts: list, *, max_new_tokens: int = 64,
                 max_block_size: int = DEFAULT_BLOCK_SIZE):
        """prompts: token-id lists (or 1-D tensors); prompts of equal length are continued in one batch."""
        self.target, self.max_new_tokens, self.max_block_size = target, max_new_tokens, max_block_size
        device = next(target.parameters()).device
        every_layer = list(range(target.config.num_hidden_layers))
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        self.items = [None] * len(prompts)  # (greedy sequence (T,), prompt length, per-layer features (L, T, H))
        for P, which in by_length.items():
            ids = torch.stack([torch.as_tensor(prompts[i], dtype=torch.long) for i in which]).to(device)  # (n, P)
            g = greedy_generate(target, ids, max_new_tokens + max_block_size)  # (n, T)
            aux = target_forward(target, g, every_layer, use_cache=False, with_logits=False).aux_hidden
            per_layer = aux.unflatten(-1, (len(every_layer), -1)).permute(0, 2, 1, 3)  # (n, L, T, H)
            for row, i in enumerate(which):
                self.items[i] = (g[row], P, per_layer[row])

    @torch.no_grad()
    def __call__(self, drafter, block_size: int | None = None) -> SpecDecodeStats:
        """Acceptance counters of greedy DFlash decoding with ``drafter`` at ``block_size`` (default: its own)."""
        drafter = require_dflash(drafter, "AcceptanceProbe")
        bs = block_size or drafter.config.block_size
        if bs > self.max_block_size:
            raise ValueError(f"`block_size` {bs} is larger than the probe's max_block_size {self.max_block_size}")
        was_training = drafter.training
        drafter.eval()
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (bs - 1))
        ids = drafter.config.target_layer_ids
        for g, P, per_layer in self.items:
            aux = per_layer[ids].transpose(0, 1).flatten(1)[None]  # (1, T, n_aux * H), layers ascending
            drafts = drafts_at_every_anchor(self.target, drafter, g, P, self.max_new_tokens, bs, aux=aux)
            replay_greedy_decoding(g, drafts, P, self.max_new_tokens, stats)
        drafter.train(was_training)
        return stats


def load_pair_for_eval(target_dir, drafter_dir, device):
    """Target and drafter as shipped (bf16 weights), computed in float32; their files checked first."""
    from ..pair_files import check_pair_files

    check_pair_files(target_dir, drafter_dir)
    target = freeze(load_target(target_dir, device=device, dtype=torch.float32))
    drafter = freeze(load_drafter(drafter_dir, device=device, dtype=torch.float32))
    return target, drafter


def print_acceptance(ev: AcceptanceEval) -> None:
    rates = " ".join(f"{r:.2f}" for r in ev.stats.per_position_acceptance_rate)
    print(f"block {ev.block_size}: mean acceptance length {ev.stats.mean_acceptance_length:.3f} over "
          f"{ev.stats.num_drafts} drafts ({ev.num_prompts} prompts); every-anchor estimate "
          f"{ev.every_anchor_mean_acceptance_length:.3f}\n  per-position acceptance: {rates}")


def run_evaluate(args) -> None:
    """`python -m dflash_lab.train evaluate`: acceptance of a target/drafter pair on the held-out prompts."""
    clock = Clock()
    device = resolve_device(args.device, caller="train evaluate")
    tokenizer = load_tokenizer(args.target)
    prompts = corpus.load_prompts(args.prompts)[: args.eval_prompts]
    target, drafter = load_pair_for_eval(args.target, args.drafter, device)
    blocks = [int(b) for b in args.eval_blocks.split(",")]
    evs = evaluate_acceptance(target, drafter, tokenizer, prompts, block_sizes=blocks, show_progress=True)
    for ev in evs.values():
        print_acceptance(ev)
    print(f"{clock.elapsed():.0f}s on {device}")
    if args.update_log:
        update_training_log(args.drafter, {bs: ev.record() for bs, ev in evs.items()}, device)


def update_training_log(drafter_dir, records: dict, device) -> Path:
    """Write held-out acceptance records ({block size: ``AcceptanceEval.record()``}) into a drafter's
    training log, under ``final`` (what chapter 6 and the README read)."""
    path = Path(drafter_dir) / LOG_NAME
    log = json.loads(path.read_text()) if path.is_file() else {}  # a drafter trained elsewhere has no log yet
    log.setdefault("final", {})
    log["final"].update({f"block_{bs}": record for bs, record in records.items()}, eval_device=str(device))
    write_log(path, log)
    return path
