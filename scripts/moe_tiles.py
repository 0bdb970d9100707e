"""Time the routed experts' kernels (``spec_decode.fast.moe``) at Laguna-XS.2's shape over tile choices.

One sparse layer's routed experts alone, graphed (``bench_xs2_steps.moe_layer_diagnostics``'s setting). The
block GEMM for 1 and 16 tokens, at each (block_n, block_k, num_warps, num_stages) below; with --gemv the
one-token GEMV kernel at each (block_n, block_k, num_warps), beside the block GEMM running the same token as
the decode step ran it before (one 16-row block per chosen expert); with --dense each one-row shape of a token
(``gemv.linear``: qkv, o_proj, router | shared, the dense layer) over its own tiles, and the residual tail's
warps. Needs CUDA.

    python scripts/moe_tiles.py [--gemv | --dense]
"""

import itertools
import sys
from types import SimpleNamespace

import torch

from dflash_lab.presets import LAGUNA_XS_2_FULL
from dflash_lab.spec_decode.fast import gemv, moe
from dflash_lab.measure.timing import graphed_ms

LAYERS = 8  # one-token calls a graph in the GEMV sweep, each on different experts


def block_path_one_token(ex, x, selected, weights):
    """One token through the block GEMMs (the decode step before the GEMV kernel): k blocks of 16 rows."""
    k = selected.shape[1]
    row_pair, used, rows, _, token_of_row = moe._one_token(k, moe.BLOCK_M, x.device)
    h = torch.empty(rows.numel(), ex.gate_up_proj.shape[1], device=x.device, dtype=x.dtype)
    sel = selected.reshape(-1)
    moe._block_gemm(x, token_of_row, ex.gate_up_proj, h, rows, row_pair, sel, used, None, k)
    out = torch.empty(k, ex.down_proj.shape[1], device=x.device, dtype=x.dtype)
    moe._block_gemm(h, rows, ex.down_proj, out, row_pair, row_pair, sel, used, weights.reshape(-1), k, True)
    return out


def gemv_sweep(ex, x, weights, dev) -> dict:
    """Each projection's GEMV tile over the choices, the other projection at its default; the best are set in
    ``gemv.TILES`` and returned. One graph runs LAYERS one-token calls whose experts are all different (the
    chosen weights of one call would otherwise stay in L2 between calls); ms per call."""
    E, k = ex.gate_up_proj.shape[0], weights.shape[1]
    sels = torch.randperm(E, generator=torch.Generator().manual_seed(7))[:LAYERS * k].view(LAYERS, 1, k).to(dev)
    calls = lambda path: [path(ex, x, s, weights) for s in sels]  # noqa: E731
    ref = block_path_one_token(ex, x, sels[0], weights).float()
    block_ms = graphed_ms(lambda: calls(block_path_one_token), dev) / LAYERS
    print(f"block GEMM path, 1 token: {block_ms:.4f} ms a call (tile {moe.TILES}), {LAYERS} calls a graph\n")
    gemv_call = lambda e, x_, s, w: moe.gathered_experts(e, x_, s, w, reduce=False)  # noqa: E731
    best = {}
    for proj, ks in (("gate_up", (512, 1024, 2048)), ("down", (256, 512))):
        default = dict(gemv.TILES[proj])
        print(f"| {proj} block_n | block_k | warps | pipe | 1 token ms | x block path | max rel. diff |\n"
              "|---|---|---|---|---|---|---|")
        timed = []
        for bn, bk, w, pipe in itertools.product((4, 8, 16), ks, (2, 4), (False, True)):
            gemv.TILES[proj] = dict(block_n=bn, block_k=bk, num_warps=w, pipe=pipe)
            try:
                out = gemv_call(ex, x, sels[0], weights)[0].float()
                ms = graphed_ms(lambda: calls(gemv_call), dev, reps=100) / LAYERS
            except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                print(f"| {bn} | {bk} | {w} | {pipe} | {type(e).__name__} | | |")
                continue
            diff = ((out - ref).abs().max() / ref.abs().max()).item()
            mark = " (default)" if gemv.TILES[proj] == default else ""
            print(f"| {bn} | {bk} | {w} | {pipe} | {ms:.4f}{mark} | {ms / block_ms:.2f} | {diff:.1e} |", flush=True)
            timed.append((ms, dict(gemv.TILES[proj])))
        best[proj] = min(timed, key=lambda t: t[0])[1]
        gemv.TILES[proj] = best[proj]
        print(f"\nbest {proj}: {best[proj]}\n")
    ms = graphed_ms(lambda: calls(gemv_call), dev, reps=200) / LAYERS
    print(f"both at their best: {ms:.4f} ms a call, {ms / block_ms:.2f}x the block path")
    best["dense"] = dense_sweep(dev)
    best["route_warps"] = route_sweep(dev)
    return best


def route_sweep(dev) -> int:
    """``moe.fused_route`` for one token at XS.2's router (256 experts, top-8) over its warps, LAYERS calls a
    graph; sets and returns the fastest."""
    cfg = SimpleNamespace(**LAGUNA_XS_2_FULL)
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = [torch.randn(1, cfg.num_experts, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    bias = torch.randn(cfg.num_experts, device=dev, generator=g) * 0.1
    calls = lambda: [moe.fused_route(x, bias, cfg.num_experts_per_tok, torch.bfloat16) for x in logits]  # noqa: E731
    ref = calls()
    same = lambda: f", same experts: {all(torch.equal(a[1], b[1]) for a, b in zip(calls(), ref))}"  # noqa: E731
    return warps_sweep(moe, "ROUTE_WARPS", "router, 1 token", calls, dev, (1, 2, 4, 8), same)


def warps_sweep(module, name: str, what: str, calls, dev, choices, note=lambda: "") -> int:
    """``module.name`` (a kernel's warps) at each of ``choices``, ``calls`` timed graphed (LAYERS calls a graph);
    sets and returns the fastest. note(): what to add to each line (a check of the results)."""
    timed = []
    for w in choices:
        setattr(module, name, w)
        ms = graphed_ms(calls, dev, reps=100) / LAYERS
        print(f"{what}, {w} warp(s): {ms * 1e3:.2f} us a call{note()}", flush=True)
        timed.append((ms, w))
    setattr(module, name, min(timed)[1])
    print(f"best {what} warps: {min(timed)[1]}\n")
    return min(timed)[1]


def dense_sweep(dev) -> dict:
    """``gemv.linear``'s tile over one-row products at a sparse layer's dense shapes (qkv+gate of a sliding
    layer, o_proj, the router | shared gate | up, the shared down), LAYERS copies of each so none stays in L2,
    against F.linear (cuBLAS); sets the best tile, and ``gemv.DENSE`` to whichever is faster."""
    cfg = SimpleNamespace(**LAGUNA_XS_2_FULL)
    H, hd, I_s = cfg.hidden_size, cfg.head_dim, cfg.shared_expert_intermediate_size
    heads = max(cfg.num_attention_heads_per_layer) if hasattr(cfg, "num_attention_heads_per_layer") else 64
    shapes = [(heads * hd + 2 * cfg.num_key_value_heads * hd + heads, H), (H, heads * hd),
              (cfg.num_experts + 2 * I_s, H), (H, I_s)]
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [[torch.randn(n, kk, device=dev, dtype=torch.bfloat16, generator=g) * .02 for n, kk in shapes]
          for _ in range(LAYERS)]
    xs = {kk: torch.randn(1, kk, device=dev, dtype=torch.bfloat16, generator=g) for _, kk in shapes}
    step = lambda f: [f(xs[w.shape[1]], w) for layer in ws for w in layer]  # noqa: E731
    cublas = graphed_ms(lambda: step(torch.nn.functional.linear), dev, reps=100) / LAYERS
    print(f"dense shapes {shapes}: F.linear (cuBLAS) {cublas:.4f} ms a layer\n")
    print("| dense block_n | block_k | warps | pipe | ms a layer | x cuBLAS | max rel. diff |\n|---|---|---|---|---|---|---|")
    ref = [torch.nn.functional.linear(xs[w.shape[1]], w).float() for w in ws[0]]
    gemv.DENSE, timed = True, []
    for bn, bk, w, pipe in itertools.product((4, 8, 16), (512, 1024), (2, 4), (False, True)):
        gemv.TILES["dense"] = dict(block_n=bn, block_k=bk, num_warps=w, pipe=pipe)
        try:
            outs = [gemv.linear(xs[wt.shape[1]], wt).float() for wt in ws[0]]
            ms = graphed_ms(lambda: step(gemv.linear), dev, reps=100) / LAYERS
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            print(f"| {bn} | {bk} | {w} | {pipe} | {type(e).__name__} | | |")
            continue
        diff = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref))
        print(f"| {bn} | {bk} | {w} | {pipe} | {ms:.4f} | {ms / cublas:.2f} | {diff:.1e} |", flush=True)
        timed.append((ms, dict(gemv.TILES["dense"])))
    ms, best = min(timed, key=lambda t: t[0])
    gemv.TILES["dense"], gemv.DENSE = best, ms < cublas
    print(f"\nbest dense: {best}, {ms:.4f} ms a layer against cuBLAS {cublas:.4f}: DENSE = {gemv.DENSE}\n")
    return best


def xs2_dense_shapes(cfg) -> dict[tuple[int, int], str]:
    """The one-row products of a Laguna-XS.2 token that ``gemv.linear`` serves: (rows, columns) of each weight ->
    the projections of that shape."""
    H, hd, nkv, I_s = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size
    roles = []
    for h in sorted(set(cfg.num_attention_heads_per_layer), reverse=True):  # q | k | v | per-head gate, o_proj
        roles += [(f"qkv+gate, {h} heads", (h * hd + 2 * nkv * hd + h, H)), (f"o_proj, {h} heads", (H, h * hd))]
    roles += [("router | shared gate | up", (cfg.num_experts + 2 * I_s, H)),
              ("dense layer gate | up", (2 * cfg.intermediate_size, H)),
              ("dense layer down", (H, cfg.intermediate_size))]
    shapes: dict[tuple[int, int], str] = {}
    for role, shape in roles:
        shapes[shape] = f"{shapes[shape]}; {role}" if shape in shapes else role
    return shapes


def dense_tiles(block_ns=(1, 2, 4, 8), block_ks=(256, 512, 1024, 2048), warps=(1, 2, 4, 8), most=128):
    """The tiles the per-shape sweep tries: at most ``most`` float32 sums a thread (more spill registers)."""
    return [dict(block_n=bn, block_k=bk, num_warps=w, pipe=False)
            for bn, bk, w in itertools.product(block_ns, block_ks, warps) if 4 <= bn * bk // (32 * w) <= most]


def shape_sweep(dev) -> dict:
    """Each one-row shape of a Laguna-XS.2 token (``xs2_dense_shapes``) alone, LAYERS copies a graph, over
    ``dense_tiles`` (and the pipelined loop at the best three), beside the shared "dense" tile and cuBLAS; sets
    ``gemv.TILES["dense NxK"]`` where a tile beats the shared one, and returns those entries."""
    cfg = SimpleNamespace(**LAGUNA_XS_2_FULL)
    g = torch.Generator(device="cuda").manual_seed(3)
    gemv.DENSE, found, shared = True, {}, dict(gemv.TILES["dense"])
    total = {"cuBLAS": 0.0, "shared tile": 0.0, "own tile": 0.0}
    for (n, k), role in xs2_dense_shapes(cfg).items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * .02 for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x, ws[0]).float()
        cublas = graphed_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws], dev, reps=100) / LAYERS
        name = f"dense {n}x{k}"
        print(f"{role}: {n} x {k}, {n * k * 2 / 1e6:.1f} MB; cuBLAS {cublas * 1e3:.2f} us\n")
        print("| block_n | block_k | warps | pipe | us | x cuBLAS | GB/s | max rel. diff |\n"
              "|---|---|---|---|---|---|---|---|")
        timed = []

        def run(tile, mark=""):
            gemv.TILES[name] = tile
            try:
                diff = ((gemv.linear(x, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
                ms = graphed_ms(lambda: [gemv.linear(x, w) for w in ws], dev, reps=100) / LAYERS
            except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                print(f"| {tile['block_n']} | {tile['block_k']} | {tile['num_warps']} | {tile['pipe']} | "
                      f"{type(e).__name__} | | | |")
                return
            print(f"| {tile['block_n']} | {tile['block_k']} | {tile['num_warps']} | {tile['pipe']} | "
                  f"{ms * 1e3:.2f}{mark} | {ms / cublas:.2f} | {n * k * 2 / ms / 1e6:.0f} | {diff:.1e} |", flush=True)
            timed.append((ms, dict(tile)))

        run(dict(shared), " (shared)")
        at_shared = timed[0][0] if timed else float("inf")
        for tile in dense_tiles():
            if tile != shared:
                run(tile)
        for _, tile in sorted(timed, key=lambda t: t[0])[:3]:
            run(dict(tile, pipe=True))
        ms, best = min(timed, key=lambda t: t[0])
        if ms < at_shared:
            gemv.TILES[name] = found[name] = best
        else:
            del gemv.TILES[name]
        total["cuBLAS"] += cublas
        total["shared tile"] += at_shared
        total["own tile"] += min(ms, at_shared)
        print(f"\n{role}: best {best}, {ms * 1e3:.2f} us (shared tile {at_shared * 1e3:.2f}, cuBLAS "
              f"{cublas * 1e3:.2f})\n")
    print("one of each shape, us: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in total.items()) + "\n")
    print(f"per-shape tiles for gemv.CARD_TILES: {found}\n")
    return found


def residual_sweep(dev) -> int:
    """``residual``'s tail kernel at XS.2's width over its warps: LAYERS sparse tails (8 expert outputs, the
    shared expert's) and LAYERS dense ones a graph; sets and returns the fastest."""
    from dflash_lab.spec_decode.fast import residual

    cfg = SimpleNamespace(**LAGUNA_XS_2_FULL)
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(4)
    r = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    norm = torch.nn.RMSNorm(H, eps=1e-6, device=dev, dtype=torch.bfloat16)
    hs, outs, shared = [r(1, 1, H) for _ in range(LAYERS)], [r(1, k, H) for _ in range(LAYERS)], r(1, 1, H)

    def tails():
        for h, o in zip(hs, outs):
            h2, x = residual.experts_add_norm(h, o, 2.5, shared, norm)
            residual.add_norm(h2, x, norm)

    return warps_sweep(residual, "WARPS", "residual tails (a sparse and a dense a layer)", tails, dev, (1, 2, 4, 8, 16))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    cfg, dev = SimpleNamespace(**LAGUNA_XS_2_FULL), torch.device("cuda")
    print(f"{gemv.use_card_tiles(dev)}: the one-row kernel's tiles before the sweep {gemv.TILES}\n")
    E, H, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(0)
    ex = SimpleNamespace(gate_up_proj=torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * .02,
                         down_proj=torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * .02,
                         act_fn=torch.nn.functional.silu)
    default = dict(moe.TILES)
    cases = {}
    for n in (1, 16):
        cpu = torch.Generator().manual_seed(n)
        selected = torch.stack([torch.randperm(E, generator=cpu)[:k] for _ in range(n)]).to(dev)
        cases[n] = (torch.randn(n, H, device=dev, dtype=torch.bfloat16, generator=g), selected,
                    torch.rand(n, k, generator=cpu).to(dev, torch.bfloat16))
    if "--dense" in sys.argv[1:]:
        shape_sweep(dev)
        residual_sweep(dev)
        return 0
    if "--gemv" in sys.argv[1:]:
        gemv_sweep(ex, cases[1][0], cases[1][2], dev)
        return 0
    print("| block_n | block_k | warps | stages | 1 token ms | 16 tokens ms |\n|---|---|---|---|---|---|")
    for bn, bk, w, st in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        moe.TILES.update(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        try:
            ms = [graphed_ms(lambda c=cases[n]: moe.gathered_experts(ex, *c), dev) for n in (1, 16)]
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            print(f"| {bn} | {bk} | {w} | {st} | {type(e).__name__} | |")
            continue
        mark = " (default)" if moe.TILES == default else ""
        print(f"| {bn} | {bk} | {w} | {st} | {ms[0]:.4f} | {ms[1]:.4f}{mark} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
