"""DDTree: a draft tree from ONE DFlash block, verified in ONE target forward (arXiv 2604.12989).

A DFlash block gives, at every depth d = 1 .. K after x_t, a distribution q_d over the
vocabulary. The chain keeps only argmax q_d at each depth. DDTree spends a node budget
instead: it scores a prefix (y_1 .. y_d) by its path probability q_1(y_1) ... q_d(y_d)
(the drafter's factorised estimate that the target accepts that whole prefix) and keeps
the ``budget`` prefixes that score highest. No retraining: the drafter and its one
forward are the chain's.

    build    ``build_draft_tree``: the ``budget`` best prefixes. The paper grows them best
             first from a heap (pop the best prefix; push its next sibling and its first
             child; ``best_first_tree`` does exactly that, one prefix at a time, on the
             host). Here the same set is found with fixed shapes on the device: a beam of
             ``budget`` prefixes per depth (a prefix in the best ``budget`` of its depth has
             its parent in the best ``budget`` of the depth before, since a parent scores at
             least as much as its children), then the ``budget`` best of all depths. Only
             extensions (beam i, rank j) with (i + 1)(j + 1) <= budget can make a beam (that
             many score at least as much), about budget * ln(budget) of budget^2.
             Nodes come out best first, so a parent always precedes its children.
    verify   one target forward over [x_t, nodes] with tree positions (t + depth) and a
             tree attention mask (a node sees the context and its own ancestors), its
             logits at every node: the target's choice after each prefix of the tree
    accept   ``accept_path``: from the root, step to the child whose token is the target's
             choice, while there is one; the target's choice at the last node reached is
             the bonus token. Greedy, that is the target's argmax at each node; sampling,
             a token drawn from the target's own distribution at each node (DDTree keeps
             the target's decoding rule, so each emitted token is a sample of the target
             given its prefix: lossless, with no draft probabilities in the rule)
    keep     only the accepted path's K/V stay in the target's cache, moved to the slots
             its positions own (``compact_cache``), and only its target features go to the
             drafter's context K/V

vLLM 0.33 has no tree verification for DFlash. The lab counts a tree step in vLLM's
counters so: one draft per step, every verified node a draft token, and the accepted
path's depths as the accepted positions (so tau = 1 + accepted / drafts keeps its meaning,
and the per-position counts stay per depth, K long).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layers import additive_mask
from ..runtime import is_int


MAX_BUDGET = 1024  # the paper's largest; the build holds budget x min(budget, V) candidates per depth


@dataclass
class DraftTree:
    """``b`` trees of ``budget`` nodes each (device tensors). Node i of a row is verified at index i + 1;
    index 0 is the root, x_t."""

    token_ids: torch.Tensor  # (b, N) each node's token, best first
    parents: torch.Tensor  # (b, N) the parent's index: 0 = the root, j = node j - 1
    depths: torch.Tensor  # (b, N) 1 .. K
    log_weights: torch.Tensor  # (b, N) log q_1(y_1) + ... + log q_d(y_d) of the node's prefix
    ancestors: torch.Tensor  # (b, N+1, N+1) bool: [i, j] = index j is index i or one of its ancestors
    depth_limit: int  # K, the block's drafted depths (a static number: no read-back)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    def depths_with_root(self) -> torch.Tensor:
        """(b, N+1): 0 for the root, then each node's depth."""
        return torch.cat([torch.zeros_like(self.depths[:, :1]), self.depths], dim=1)

    def parents_with_root(self) -> torch.Tensor:
        """(b, N+1): the root is its own parent."""
        return torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], dim=1)


def check_budget(budget, vocab_size: int, depth: int = 1) -> int:
    """A node budget: an integer >= 1 that ``depth`` levels of a ``vocab_size`` vocabulary can fill."""
    if not is_int(budget) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"tree_budget must be an integer in 1 .. {MAX_BUDGET} (nodes per tree), got {budget!r}")
    if budget > sum(vocab_size ** d for d in range(1, depth + 1)):
        raise ValueError(f"tree_budget {budget} is more than the {depth}-deep prefixes of a {vocab_size}-token "
                         "vocabulary")
    return int(budget)


def _descending(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, largest first; equal values keep their order (stable)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, order), order


def beam_loop(first: torch.Tensor, ext_lp: torch.Tensor, beam: torch.Tensor, budget: int):
    """The best ``budget`` prefixes of each depth from those of the depth before, three kernels a depth.

    first (b, budget): depth 1's weights, best first; ext_lp (b, K-1, C): each extension's log q at depths
    2 .. K; beam (C,): the beam each extends. -> weights (b, K, budget), best first at every depth, and
    (b, K-1, budget) the extensions chosen at depths 2 .. K (None when K = 1)."""
    weights, found = [first], []
    for d in range(ext_lp.shape[1]):
        w, idx = (weights[-1].gather(1, beam.expand(first.shape[0], -1)) + ext_lp[:, d]).topk(budget, dim=-1)
        weights.append(w)
        found.append(idx)
    return torch.stack(weights, 1), (torch.stack(found, 1) if found else None)


def build_draft_tree(draft_logits: torch.Tensor, budget: int, *, beams=beam_loop) -> DraftTree:
    """The ``budget`` prefixes of highest path probability under the per-depth distributions of one block.

    draft_logits: (K, V) or (b, K, V), depth d = 1 .. K (the drafter's ``block_logits`` after x_t).
    Fixed shapes, no host sync: it runs inside a captured step. ``beams``: how each depth's best prefixes are
    found (``beam_loop``, or the fast path's one-kernel search). Where weights tie the set may differ from the
    heap's by equal-weight prefixes, but a parent always comes with its child.
    """
    if draft_logits.dim() == 2:
        draft_logits = draft_logits[None]
    b, K, V = draft_logits.shape
    if K < 1:
        raise ValueError("a draft tree needs at least one drafted depth (block_size >= 2)")
    budget = check_budget(budget, V, K)
    k = min(budget, V)  # candidates per depth
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    top_lp, top_ids = log_q.topk(k, dim=-1)  # (b, K, k), best first at every depth
    pad = budget - k  # a vocabulary smaller than the budget: depth 1 has k prefixes, the rest are -inf
    first = F.pad(top_lp[:, 0], (0, pad), value=float("-inf"))
    beam, rank = _pairs(budget, k, log_q.device)  # the (beam, rank) extensions that can be among the best
    ext_lp = top_lp[:, 1:].gather(2, rank.expand(b, K - 1, -1))  # (b, K-1, C)
    weights, idx = beams(first, ext_lp, beam, budget)  # (b, K, budget); (b, K-1, budget) into the extensions
    picks = [torch.arange(budget, device=log_q.device).expand(b, 1, -1)]  # depth 1: beam j is the rank-j token
    if idx is not None:
        picks.append(beam[idx] * k + rank[idx])  # parent beam * k + rank
    # Equal weights inside a depth may come in any order (any of them is a best prefix); across depths the
    # stable sort keeps depth-major order, so a parent whose child scores the same is chosen first.
    chosen_w, chosen = _descending(weights.flatten(1), budget)  # over (K, budget)
    depth0 = chosen // budget  # 0-based depth of each node
    pick = torch.cat(picks, 1).flatten(1).gather(1, chosen)
    first = depth0 == 0
    rank = torch.where(first, pick, pick % k)
    token_ids = top_ids.flatten(1).gather(1, (depth0 * k + rank).clamp(max=K * k - 1))
    token_ids = torch.where(first & (rank >= k), 0, token_ids)  # a padded depth-1 beam (never chosen)
    # each chosen (depth, beam) -> its verify index; the parent is (depth - 1, its pick // k)
    index = torch.zeros(b, K * budget, dtype=torch.long, device=draft_logits.device)
    index.scatter_(1, chosen, torch.arange(1, budget + 1, device=index.device).expand(b, -1))
    parent_beam = pick // k
    parent_flat = ((depth0 - 1).clamp(min=0) * budget + parent_beam)
    parents = torch.where(depth0 > 0, index.gather(1, parent_flat), 0)
    tree = DraftTree(token_ids, parents, depth0 + 1, chosen_w, None, K)
    tree.ancestors = _ancestors(tree.parents_with_root(), K)
    return tree


_PAIRS: dict = {}


def _pairs(budget: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(beam, rank) of every extension of a sorted beam by a sorted depth that can rank in the best ``budget``:
    (beam + 1) * (rank + 1) <= budget, since that many extensions score at least as much as it. About
    budget * ln(budget) of budget * k (cached per device: a captured step reads them, never builds them)."""
    key = (budget, k, str(device))
    if key not in _PAIRS:
        pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
        _PAIRS[key] = tuple(torch.tensor(x, dtype=torch.long, device=device) for x in zip(*pairs))
    return _PAIRS[key]


def _ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(b, N+1) parent indices -> (b, N+1, N+1) bool ancestor-or-self matrix (``depth`` doublings suffice)."""
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    up = parents
    for _ in range(max(depth, 1).bit_length()):  # after i rounds every ancestor within 2**i steps is set
        anc |= anc.gather(1, up[:, :, None].expand(b, n, n))
        up = up.gather(1, up)
    return anc


def best_first_tree(log_q: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    """The paper's construction, one prefix at a time from a heap (host, one row): (K, V) log q ->
    [(parent index, depth, token), ...] in the order popped. The reference ``build_draft_tree`` is
    tested against, and the chapter's step-through."""
    K, V = log_q.shape
    budget = check_budget(budget, V, K)
    k = min(budget, V)
    top_lp, top_ids = (t.tolist() for t in log_q.float().topk(k, dim=-1))
    heap = [(-top_lp[0][0], (0,), 0)]  # (-path log prob, ranks, parent index): the best child of the root
    nodes = []
    while heap and len(nodes) < budget:
        neg_w, ranks, parent = heapq.heappop(heap)
        depth, rank = len(ranks), ranks[-1]
        nodes.append((parent, depth, top_ids[depth - 1][rank]))
        here, w = len(nodes), -neg_w
        if rank + 1 < k:  # its next sibling
            sib = w - top_lp[depth - 1][rank] + top_lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent))
        if depth < K:  # its first child
            heapq.heappush(heap, (-(w + top_lp[depth][0]), ranks + (0,), here))
    return nodes


# ---------------------------------------------------------------------------
# Verification: the tree's attention, the accepted path, the caches
# ---------------------------------------------------------------------------


def tree_visible(tree: DraftTree, start: torch.Tensor, key_slots: torch.Tensor, windows) -> dict:
    """{window: (b, N+1, S) bool}: which key slot each tree index attends to, for trees written at slots
    start .. start+N, under each of ``windows`` (None: full attention; else a sliding layer's, on positions).

    start: (b,) the root's position t (the context fills slots 0 .. t-1, slot == position). Slots below t
    are the context, slots t .. t+N the tree (a node sees its ancestors and itself), the rest nothing.
    A tree key's position is t + its depth.
    """
    b, n = tree.token_ids.shape[0], tree.num_nodes + 1
    rel = key_slots[None, :] - start[:, None]  # (b, S): the tree index a slot holds, if 0 <= rel <= N
    in_tree = (rel >= 0) & (rel < n)
    idx = rel.clamp(0, n - 1)
    visible = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree.ancestors.gather(2, idx[:, None, :].expand(b, n, -1)))
    out = {}
    if any(w is not None for w in windows):
        depth = tree.depths_with_root()
        key_pos = torch.where(in_tree, start[:, None] + depth.gather(1, idx), key_slots[None, :])
        behind = (start[:, None] + depth)[:, :, None] - key_pos[:, None, :]  # (b, N+1, S) query - key position
    for w in windows:
        out[w] = visible if w is None else visible & (behind < w)
    return out


def tree_attention_masks(tree: DraftTree, start: int, config, dtype: torch.dtype) -> dict:
    """transformers' per-layer-type masks for one tree verified after ``start`` cached positions:
    {layer type: (1, 1, N+1, start+N+1) additive}, the dict ``LagunaModel.forward`` takes as attention_mask."""
    device = tree.token_ids.device
    slots = torch.arange(start + tree.num_nodes + 1, device=device)
    t = torch.tensor([start], device=device)
    windows = {"full_attention": None, "sliding_attention": getattr(config, "sliding_window", None)}
    visible = tree_visible(tree, t, slots, set(windows.values()))
    return {kind: additive_mask(visible[windows[kind]], dtype)[:, None] for kind in set(config.layer_types)}


def accept_path(tree: DraftTree, target_tokens: torch.Tensor, max_depth: torch.Tensor | None = None):
    """Walk every row's tree along the target's choices.

    target_tokens: (b, N+1) the target's token after each tree index (argmax, or a sample of its
    distribution). ``max_depth`` (b,): deeper nodes are never accepted (the length limit).
    Returns n (b,) accepted drafts, path (b, K+1) the tree indices of depths 0 .. K on the accepted path
    (0 past n), and next_token (b,) the target's choice at the deepest accepted index (the bonus).
    """
    b, n_idx = target_tokens.shape
    K = tree.depth_limit
    depth = tree.depths_with_root()
    parents = tree.parents_with_root()
    tokens = torch.cat([torch.full_like(tree.token_ids[:, :1], -1), tree.token_ids], dim=1)
    match = tokens == target_tokens.gather(1, parents)  # the node is the target's choice after its parent
    match[:, 0] = True
    if max_depth is not None:
        match &= depth <= max_depth[:, None]
    on_path = ~(tree.ancestors & ~match[:, None, :]).any(-1)  # every ancestor-or-self matches
    n = on_path.sum(-1) - 1
    path = torch.zeros(b, K + 2, dtype=torch.long, device=target_tokens.device)
    slot = torch.where(on_path, depth, K + 1)  # off-path indices go to a scratch column
    path.scatter_(1, slot, torch.arange(n_idx, device=path.device).expand(b, -1).contiguous())
    path = path[:, :K + 1]
    path = torch.where(torch.arange(K + 1, device=path.device) <= n[:, None], path, 0)
    deepest = path.gather(1, n[:, None])
    return n, path, target_tokens.gather(1, deepest)[:, 0]


def compact_cache(cache, start: int, path: list[int]) -> None:
    """Keep the context (slots < start), the root (slot start) and the accepted path's slots, in that order,
    in every layer of a transformers ``DynamicCache`` (what a crop is to the chain)."""
    device = cache.layers[0].keys.device
    keep = torch.tensor(list(range(start + 1)) + [start + i for i in path[1:]], device=device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)
