"""Time the static path's attention kernel for one decode token at Laguna-XS.2's shape over its split choices.

One token (batch 1) attending to a 1024-token context through ``attention.gated_attention``, graphed: a
full-attention layer (48 query heads) and a sliding one (64 query heads, window 512), 8 KV heads of 128.
Each graph runs LAYERS calls, each over its own cache (so the caches do not stay in L2 between calls), in
the mix of the real target (one full to three sliding). For each (SPLIT_SLOTS, MAX_SPLITS, BLOCK_N) below,
with the splits merged by the last of them (one launch) and by a second kernel, the ms per layer; the
fastest is set in the module and printed. Needs CUDA.

    python scripts/attention_splits.py
"""

import sys

import torch

from dflash_lab.measure.timing import graphed_ms
from dflash_lab.spec_decode.fast import attention

LAYERS, CONTEXT, NKV, HD, WINDOW = 40, 1024, 8, 128, 512
CHOICES = [(128, 8, 32), (64, 16, 32), (64, 16, 64), (32, 32, 32), (128, 8, 64), (256, 4, 64), (64, 8, 32)]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16, generator=g)
    S = CONTEXT + 32  # the static cache's capacity: the context and a block, 16-aligned
    layers = []
    for i in range(LAYERS):
        heads, window = (48, None) if i % 4 == 0 else (64, WINDOW)
        layers.append((torch.randn(1, 1, heads, HD, **bf), torch.randn(1, NKV, S, HD, **bf),
                       torch.randn(1, NKV, S, HD, **bf), torch.randn(1, 1, heads, **bf), window))
    qpos = torch.full((1, 1), CONTEXT, device=dev, dtype=torch.int32)

    def calls():
        return [attention.gated_attention(q, k, v, gate, qpos, HD ** -0.5, window=w) for q, k, v, gate, w in layers]

    default = (attention.SPLIT_SLOTS, attention.MAX_SPLITS, attention.BLOCK_N, attention.MERGE_IN_LAST)
    ref = [o.float() for o in calls()]
    print(f"| slots a split | max splits | block_n | merge | splits here | ms a layer | max rel. diff |\n"
          f"|---|---|---|---|---|---|---|")
    timed = []
    for slots, most, block_n in CHOICES:
        for merge in (True, False):
            attention.SPLIT_SLOTS, attention.MAX_SPLITS, attention.BLOCK_N = slots, most, block_n
            attention.MERGE_IN_LAST = merge
            out = calls()
            diff = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(out, ref))
            ms = graphed_ms(calls, dev, reps=100) / LAYERS
            mark = " (default)" if (slots, most, block_n, merge) == default else ""
            print(f"| {slots} | {most} | {block_n} | {'last split' if merge else 'second kernel'} | "
                  f"{attention.num_splits(S)} | {ms:.4f}{mark} | {diff:.1e} |", flush=True)
            timed.append((ms, (slots, most, block_n, merge)))
    best = min(timed)[1]
    attention.SPLIT_SLOTS, attention.MAX_SPLITS, attention.BLOCK_N, attention.MERGE_IN_LAST = best
    print(f"\nbest: SPLIT_SLOTS={best[0]}, MAX_SPLITS={best[1]}, BLOCK_N={best[2]}, MERGE_IN_LAST={best[3]} "
          f"({min(timed)[0]:.4f} ms a layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
