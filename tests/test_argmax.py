"""The split greedy pick (``spec_decode.fast.argmax``) against torch's argmax, bit for bit.

In Triton's CPU interpreter the kernel must return torch's index on every row: ties (the first index),
NaN (the first NaN, above +inf), -0.0 beside 0.0, rows of -inf, widths that are not multiples of its chunk,
a single chunk and many, every floating dtype, written into a strided ``out`` as the decoder's buffer is.
The path a CUDA graph's capture takes when no counters exist (the keys reduced by torch) must agree too.
Off the kernel it is torch's argmax itself. The decoder's and the drafter's picks go through it
(``test_kernel_path`` runs both shipped drafters through the static path in the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.spec_decode.fast import argmax as fast_argmax

SCRIPT = r"""
import json, torch
from dflash_lab.spec_decode.fast import argmax as am, pdl
g = torch.Generator().manual_seed(0)
out = {}
def check(name, x, **kw):
    got = am.argmax(x, **kw)
    out[name] = [torch.equal(got, x.argmax(-1)), got.tolist()]
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for shape in [(5000,), (1, 2048), (3, 12544), (2, 3, 2049), (7, 1), (4, 6000)]:
        x = torch.randn(shape, generator=g).to(dt)
        rows = x.view(-1, x.shape[-1])
        if rows.shape[-1] > 3000:  # the maximum twice, in two programs: the first must win
            rows[0, 3000] = rows[0, rows.shape[-1] - 1] = rows.max() + 1
        check(f"{dt} {shape}", x)
x = torch.full((5, 5000), -float("inf"))
x[1, 4000] = x[1, 4500] = float("nan"); x[1, 10] = float("inf")
x[2] = 0.0; x[2, :100] = -0.0
x[3, 2100] = x[3, 4999] = 1.0
x[4, 4097] = -1e-30; x[4, 4096] = -1e-30
check("specials", x)
dst = torch.full((3, 8), -1, dtype=torch.long)
y = torch.randn(3, 5, 9000, generator=g)
am.argmax(y, out=dst[:, :5])
out["strided out"] = [torch.equal(dst[:, :5], y.argmax(-1)) and bool((dst[:, 5:] == -1).all()), dst.tolist()]
real = pdl.counters
pdl.counters = lambda *a, **k: None  # as while a graph is captured before any counter exists
check("keys reduced by torch", y)
pdl.counters = real
check("after the fallback, counters intact", y)
print(json.dumps(out))
"""


def test_split_argmax_is_torchs_in_the_triton_interpreter(interpreted):
    rows = interpreted(SCRIPT)
    assert len(rows) == 3 * 6 + 4
    wrong = {name: got for name, (ok, got) in rows.items() if not ok}
    assert not wrong, wrong
    assert rows["specials"][1] == [0, 4000, 0, 2100, 4096]


def test_off_the_kernel_it_is_torchs_argmax_and_bad_out_is_named():
    x = torch.randn(4, 300)
    assert not fast_argmax.runs(x)
    assert torch.equal(fast_argmax.argmax(x), x.argmax(-1))
    dst = torch.empty(4, dtype=torch.long)
    assert fast_argmax.argmax(x, out=dst) is dst and torch.equal(dst, x.argmax(-1))
    for bad in (torch.empty(3, dtype=torch.long), torch.empty(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"out must be int64 of shape \(4,\)"):
            fast_argmax.argmax(x, out=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_argmax_graphed_equals_torch():
    """On CUDA, eager and replayed in a graph (its counters reset by each launch), at Laguna-XS.2's vocabulary."""
    dev = torch.device("cuda")
    x = torch.randn(16, 100352, device=dev, dtype=torch.bfloat16)
    assert fast_argmax.runs(x)
    assert torch.equal(fast_argmax.argmax(x), x.argmax(-1))
    dst = torch.empty(16, device=dev, dtype=torch.long)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast_argmax.argmax(x, out=dst)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        x[5, 77] = x[5, 90000] = x.max() + 1
        graph.replay()
        assert torch.equal(dst, x.argmax(-1))
