"""The accept phase in one kernel (``spec_decode.fast.accept``) leaves every buffer as the torch phase does.

In Triton's interpreter, on random decoder states built to reach every branch: drafts agreeing for a random
prefix, rows that verify fewer drafts (n_draft) or none, stop tokens inside and after the kept prefix, rows
already ended, rows reaching their final position, a step narrower than the block (a per-batch schedule), a
target-only step (width 1), a tree step (a fixed verified count), and rows being filled by chunks
(``chunked_fill``): a prompt that ends inside the step's chunk, after it, or already ended.
"""

from __future__ import annotations

SCRIPT = r"""
import copy, json
from types import SimpleNamespace
import torch
from dflash_lab.spec_decode.fast import triton_ops
from dflash_lab.spec_decode.fast.accept import accept_step
from dflash_lab.spec_decode.fast.decoder import FastDecoder

STATE = ("tokens", "pos", "last", "active", "n_steps", "n_drafts", "draft_log", "accepted_log")

def state(batch, block, width, tree, seed, chunked=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda hi, *s: torch.randint(0, hi, s, generator=g)
    K = block - 1
    argmax = r(7, batch, block)
    drafts = argmax[:, :K].clone()  # agreeing, then broken at a random place in most rows
    cut = r(K + 2, batch)
    for i in range(batch):
        if cut[i] < K:
            drafts[i, cut[i]] = (drafts[i, cut[i]] + 1 + r(5)) % 7
    stop = torch.full((4,), -1)
    stop[:2] = torch.tensor([3, 5])
    pos = r(20, batch) + 5
    s = SimpleNamespace(
        B=block, tree_budget=tree, drafts=drafts, argmax=argmax, n_draft=r(K + 1, batch),
        tokens=r(7, batch, 64), stop_ids=stop, pos=pos, last=r(7, batch), limit=pos + r(2 * block, batch) + 1,
        active=r(4, batch) > 0, n_steps=r(3, batch), n_drafts=r(3, batch),
        draft_log=r(9, batch, 12), accepted_log=r(9, batch, 12),
        offsets=torch.arange(block), _accept_kernel=False, fill_ids=None, fill_len=torch.zeros(batch, dtype=torch.long))
    if chunked:  # rows being filled by chunks: prompts ending inside this chunk, after it, or already done
        s.fill_ids = r(7, batch, 64)
        s.fill_len = s.pos + r(2 * width + 2, batch) - 2  # pos + W - 2 .. : done here, later, or not filling
        s.active &= s.pos >= s.fill_len  # a row being filled is not live
        s.block_pos = s.pos[:, None] + s.offsets
    return s

assert triton_ops.enabled(torch.zeros(1))
rows, worst, filled = 0, [], 0
for batch, block, width, tree, seeds, chunked in ((8, 16, 16, None, 12, False), (5, 8, 4, None, 6, False),
                                                  (6, 8, 1, None, 4, False), (4, 16, 16, 12, 4, False),
                                                  (1, 16, 16, None, 6, False), (8, 16, 16, None, 8, True),
                                                  (6, 8, 4, None, 6, True), (5, 8, 1, None, 4, True)):
    for seed in range(seeds):
        torch_side = state(batch, block, width, tree, seed, chunked)
        kernel_side = copy.deepcopy(torch_side)
        FastDecoder._accept(torch_side, width)
        accept_step(kernel_side, width)
        rows += batch
        worst += [name for name in STATE if not torch.equal(getattr(torch_side, name), getattr(kernel_side, name))]
        if chunked:  # some row took its first token in this step, some still fills
            before = state(batch, block, width, tree, seed, chunked)
            filled += int(((before.pos < before.fill_len) & (torch_side.pos == before.fill_len)).sum())
        if width == block and tree is None and seed == 0:
            assert (torch_side.pos != state(batch, block, width, tree, seed).pos).any()  # the step moved rows
print(json.dumps({"rows": rows, "differ": worst, "filled": filled}))
"""


def test_the_accept_kernel_leaves_every_buffer_as_the_torch_phase(interpreted):
    out = interpreted(SCRIPT, "accept_kernel.py")
    assert out["rows"] >= 100 and out["filled"] > 10
    assert out["differ"] == [], f"buffers that differ from the torch phase: {sorted(set(out['differ']))}"
