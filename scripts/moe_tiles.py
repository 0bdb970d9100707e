"""Time the routed experts' block GEMM (``spec_decode.fast.moe``) at Laguna-XS.2's shape over tile choices.

One sparse layer's routed experts alone, graphed (``bench_xs2_steps.moe_layer_diagnostics``'s setting), for
1 and 16 tokens, at each (block_n, block_k, num_warps, num_stages) below. Needs CUDA.

    python scripts/moe_tiles.py
"""

import itertools
import sys
from types import SimpleNamespace

import torch

from dflash_lab.presets import LAGUNA_XS_2_FULL
from dflash_lab.spec_decode.fast import moe
from dflash_lab.measure.timing import graphed_ms


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    cfg, dev = SimpleNamespace(**LAGUNA_XS_2_FULL), torch.device("cuda")
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
