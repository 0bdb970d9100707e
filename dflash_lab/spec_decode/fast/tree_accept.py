"""A verified DDTree's accepted path in one kernel: the walk along the target's choices, and what the chain reads.

``tree.accept_path`` finds the accepted path with whole-tree tensor ops (which nodes match the target's
choice after their parent, which have every ancestor matching, their depths scattered into a path): about
30 launches a step, and the tree step then gathers the path's draft tokens and the target's choices along it
in a few more. Here one program per row walks the tree itself, depth by depth: at depth d it looks among the
nodes for the child of the current index whose token is the target's choice there (siblings carry distinct
tokens, so there is at most one), stops at the first depth with none or past the row's length limit, and
writes what the chain's append and accept read:

    n        (b,)      accepted drafts
    path     (b, K+1)  the tree index at each depth of the accepted path, 0 past n (the root)
    drafts   (b, K)    the accepted tokens by depth, -1 past n
    argmax   (b, K+1)  the target's choice at each index of the path (at the root past n)

``tree.accept_path`` stays the reference (the eager loop uses it) and the fallback where Triton does not run.
"""

from __future__ import annotations

import torch

from . import triton_ops
from ..tree import DraftTree, accept_path

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _walk_kernel(tok_ptr, par_ptr, choice_ptr, maxd_ptr, n_ptr, path_ptr, drafts_ptr, argmax_ptr, N, K,
                     BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_N)
        ok = j < N
        tokens = tl.load(tok_ptr + row * N + j, mask=ok, other=-1)
        parents = tl.load(par_ptr + row * N + j, mask=ok, other=-1)
        limit = tl.load(maxd_ptr + row)
        choices = choice_ptr + row * (N + 1)
        root_choice = tl.load(choices)
        tl.store(path_ptr + row * (K + 1), 0)
        tl.store(argmax_ptr + row * (K + 1), root_choice)
        cur = tl.sum(tl.zeros((BLOCK_N,), tl.int64), axis=0)  # the current tree index (0: the root)
        n = cur
        alive = cur == 0
        for d in range(1, K + 1):
            want = tl.load(choices + cur)  # the target's token after the current index
            hit = ok & (parents == cur) & (tokens == want)
            found = tl.max(tl.where(hit, j + 1, 0), axis=0).to(tl.int64)  # the matching child's index, or 0
            alive = alive & (found > 0) & (d <= limit)
            cur = tl.where(alive, found, cur)
            n = tl.where(alive, d, n)
            at = tl.where(alive, found, 0)
            tl.store(path_ptr + row * (K + 1) + d, at)
            tl.store(drafts_ptr + row * K + d - 1, tl.where(alive, want, -1))
            tl.store(argmax_ptr + row * (K + 1) + d, tl.where(alive, tl.load(choices + at), root_choice))
        tl.store(n_ptr + row, n)


def runs(choice: torch.Tensor) -> bool:
    """Whether ``walk`` takes the kernel: Triton where ``triton_ops.enabled``."""
    return triton is not None and triton_ops.enabled(choice)


def walk(tree: DraftTree, choice: torch.Tensor, max_depth: torch.Tensor, drafts: torch.Tensor,
         argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path of every row (module docstring): choice (b, N+1) the target's token after each index,
    max_depth (b,) the length limit. Writes drafts (b, K) and argmax (b, K+1) in place; returns (n, path)."""
    b, n_idx = choice.shape
    K = tree.depth_limit
    if drafts.shape != (b, K) or argmax.shape != (b, K + 1) or n_idx != tree.num_nodes + 1:
        raise ValueError(f"walk: choice {tuple(choice.shape)}, drafts {tuple(drafts.shape)}, argmax "
                         f"{tuple(argmax.shape)} do not fit {b} trees of {tree.num_nodes} nodes, depth {K}")
    if not runs(choice) or not (drafts.is_contiguous() and argmax.is_contiguous()):
        n, path, _ = accept_path(tree, choice, max_depth=max_depth)
        on_path = torch.arange(K, device=choice.device) < n[:, None]
        drafts.copy_(torch.where(on_path, tree.token_ids.gather(1, (path[:, 1:] - 1).clamp(min=0)), -1))
        argmax.copy_(choice.gather(1, path))
        return n, path
    n = torch.empty(b, device=choice.device, dtype=torch.long)
    path = torch.empty(b, K + 1, device=choice.device, dtype=torch.long)
    _walk_kernel[(b,)](tree.token_ids.contiguous(), tree.parents.contiguous(), choice.contiguous(),
                       max_depth.contiguous(), n, path, drafts, argmax, tree.num_nodes, K,
                       BLOCK_N=triton.next_power_of_2(tree.num_nodes))
    return n, path
