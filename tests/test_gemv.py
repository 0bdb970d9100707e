"""The one-row kernel (``spec_decode.fast.gemv``): ``linear`` and ``pair_gemv`` against torch.

In Triton's CPU interpreter (float32, exact products) the kernel's results must equal F.linear's to
rounding, on shapes that are not multiples of any tile; ``linear`` must fall back to F.linear where the
kernel does not serve (several rows, a bias, the switch off), and the static path must still generate
what transformers generates (``test_kernel_path`` runs both shipped drafters through it).
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.spec_decode.fast import gemv

LINEAR_SCRIPT = r"""
import json, torch
import torch.nn.functional as F
from dflash_lab.spec_decode.fast import gemv
g = torch.Generator().manual_seed(0)
out = {}
for n, k in [(1, 5), (37, 300), (130, 1100), (8, 2049)]:
    w, x = torch.randn(n, k, generator=g), torch.randn(1, 1, k, generator=g)
    y = gemv.linear(x, w)
    ref = F.linear(x, w)
    out[f"{n}x{k}"] = [list(y.shape) == list(ref.shape), ((y - ref).abs().max() / ref.abs().max()).item()]
    for name, tile in gemv.TILES.items():  # every tile in use, not only the default's, pipelined and not
        for pipe in (False, True):
            saved = dict(gemv.TILES["dense"])
            gemv.TILES["dense"] = dict(tile, pipe=pipe)
            err = ((gemv.linear(x, w) - ref).abs().max() / ref.abs().max()).item()
            out[f"{n}x{k} {name} pipe={pipe}"] = [True, err]
            gemv.TILES["dense"] = saved
# the routed experts' gate/up (silu(gate) * up) and a scaled down, each pipelined and not, against torch
E, n_out, k = 5, 24, 600
wgu, wd = torch.randn(E, 2 * n_out, k, generator=g), torch.randn(E, 40, n_out, generator=g)
a, expert, scale = torch.randn(2, k, generator=g), torch.tensor([3, 0, 4, 3]), torch.rand(4, generator=g)
gu = torch.einsum("pk,pnk->pn", a.repeat_interleave(2, 0), wgu[expert])
h_ref = torch.nn.functional.silu(gu[:, :n_out]) * gu[:, n_out:]
d_ref = torch.einsum("pk,pnk->pn", h_ref, wd[expert]) * scale[:, None]
for pipe in (False, True):
    saved = {t: dict(gemv.TILES[t]) for t in ("gate_up", "down")}
    for t in saved:
        gemv.TILES[t]["pipe"] = pipe
    h, d = torch.empty(4, n_out), torch.empty(4, 40)
    gemv.pair_gemv(a, wgu, h, expert, None, 2, silu_mul=True, tile="gate_up")
    gemv.pair_gemv(h_ref, wd, d, expert, scale, 1, tile="down")
    out[f"gate_up pipe={pipe}"] = [True, ((h - h_ref).abs().max() / h_ref.abs().max()).item()]
    out[f"down pipe={pipe}"] = [True, ((d - d_ref).abs().max() / d_ref.abs().max()).item()]
    gemv.TILES.update(saved)
x2, w2, b = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
out["rows"] = [torch.equal(gemv.linear(x2, w2), F.linear(x2, w2)), 0.0]
out["bias"] = [torch.equal(gemv.linear(x2[:1], w2, b), F.linear(x2[:1], w2, b)), 0.0]
calls = []
real = gemv.pair_gemv
gemv.pair_gemv = lambda *a, **kw: calls.append(1) or real(*a, **kw)
gemv.linear(x2[:1], w2)
gemv.DENSE = False
gemv.linear(x2[:1], w2)
out["kernel calls with DENSE on, then off"] = [calls == [1], 0.0]
# a shape with its own tile ("dense NxK", as a card's sweep sets them) takes it; another shape keeps "dense"
gemv.DENSE, tiles = True, []
gemv.pair_gemv = lambda *a, **kw: tiles.append(kw["tile"]) or real(*a, **kw)
gemv.TILES["dense 37x300"] = {"block_n": 2, "block_k": 64, "num_warps": 1, "pipe": False}
for n, k in [(37, 300), (130, 1100)]:
    w, x = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g)
    ref = F.linear(x, w)
    out[f"{n}x{k} by shape"] = [True, ((gemv.linear(x, w) - ref).abs().max() / ref.abs().max()).item()]
out["tiles looked up by shape"] = [tiles == ["dense 37x300", "dense"], 0.0]
print(json.dumps(out))
"""


def test_linear_in_the_triton_interpreter(interpreted):
    rows = interpreted(LINEAR_SCRIPT)
    for name, (ok, err) in rows.items():
        assert ok and err < 1e-5, (name, ok, err)
    assert len(rows) == 4 * (1 + 2 * len(gemv.TILES)) + 4 + 3 + 3


def test_linear_is_f_linear_off_the_kernel():
    """On this CPU without the interpreter the kernel does not run: linear is F.linear, bit for bit."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 64, generator=g), torch.randn(48, 64, generator=g)
    assert not gemv.runs(x)
    assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_linear_compiled_in_bfloat16():
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(10304, 2048), (2048, 8192), (1280, 2048), (2048, 512), (100, 300)]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * .02
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert ((gemv.linear(x, w).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (n, k)


def test_a_card_with_its_own_sweep_gets_its_tiles_once_and_a_callers_tile_stays(monkeypatch):
    """``use_card_tiles`` on an H200 (its name faked; no GPU needed): the tiles its sweep chose replace the
    defaults, once per process, except a tile a caller had already set (a sweep, a test); off CUDA nothing."""
    monkeypatch.setattr(gemv, "TILES", {k: dict(v) for k, v in gemv._DEFAULT_TILES.items()})
    monkeypatch.setattr(gemv, "_CARD", [])
    names = iter(["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert gemv.use_card_tiles(torch.device("cpu")) is None and gemv._CARD == []
    mine = {"block_n": 16, "block_k": 128, "num_warps": 8, "pipe": True}
    gemv.TILES["down"] = dict(mine)
    assert gemv.use_card_tiles(torch.device("cuda")) == "NVIDIA H200"
    h200 = gemv.CARD_TILES["H200"]
    assert gemv.TILES["gate_up"] == h200["gate_up"] != gemv._DEFAULT_TILES["gate_up"]
    assert gemv.TILES["dense"] == h200["dense"] and gemv.TILES["down"] == mine
    assert gemv.use_card_tiles(torch.device("cuda:0")) == "NVIDIA H200"  # asked once: the H100 name is never read
    gemv.TILES["dense"] = dict(gemv._DEFAULT_TILES["dense"])
    gemv.use_card_tiles(torch.device("cuda"))
    assert gemv.TILES["dense"] == gemv._DEFAULT_TILES["dense"]  # set again by a caller after the choice: kept
    for name in h200:  # a card's per-shape tiles arrive with it, and a shape's tile a caller set stays
        if name.startswith("dense "):
            n, k = map(int, name[len("dense "):].split("x"))
            assert gemv.dense_tile(n, k) == name and gemv.TILES[name] == h200[name]
    assert gemv.dense_tile(3, 5) == "dense"
    monkeypatch.setattr(gemv, "_CARD", [])
    monkeypatch.setattr(gemv, "TILES", {k: dict(v) for k, v in gemv._DEFAULT_TILES.items()})
    monkeypatch.setitem(gemv.CARD_TILES["H200"], "dense 3x5", {"block_n": 1, "block_k": 8, "num_warps": 1,
                                                               "pipe": False})
    gemv.TILES["dense 3x5"] = dict(mine)
    names = iter(["NVIDIA H200"])
    gemv.use_card_tiles(torch.device("cuda"))
    assert gemv.TILES["dense 3x5"] == mine and gemv.dense_tile(3, 5) == "dense 3x5"
