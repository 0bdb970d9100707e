"""Reading KV-cache groups back: one row per group for the figures, and memory per group.

``kv_groups`` gives vLLM's groups with the drafter's flagged; this module turns them
into plain data for ``viz`` and the chapter:

    rows      ``describe_groups``: per group its kind, KV block size, page size and
              draft flag, with one cell per layer (``format_groups`` prints them);
              ``ungrouped_layers``: the layers no group holds
    memory    ``group_memory``: page size, bytes per block and per token, and the
              capacity of each group for a KV budget, with vLLM's own block accounting

``kv_block_size`` is vLLM's cache block (tokens per KV page), not the draft block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_lab.kv_cache.grouping import grouping_config, layout_name
from dflash_lab.kv_cache.groups import group_holds_mamba, group_layer_specs
from dflash_lab.kv_cache.common import check_spec_dict, positive_int, vllm_api


def spec_kind(spec) -> str:
    """vLLM's name for a spec's kind: 'full_attention', 'sliding_window', 'mamba', 'mla_attention', ..."""
    return vllm_api().iface.get_kv_cache_spec_kind(spec).value


@dataclass(frozen=True)
class LayerCell:
    name: str
    kind: str  # vLLM's KVCacheSpecKind value of the layer as grouped
    is_draft: bool  # the layer's spec carries the draft marker
    page_size_bytes: int

    @property
    def short_name(self) -> str:
        return short_layer_name(self.name)


@dataclass(frozen=True)
class GroupRow:
    index: int
    kind: str  # the kinds of its layers, joined with '+' when they differ
    kv_block_size: int  # tokens per KV page (for Mamba: tokens per state block)
    page_size_bytes: int  # one layer's page (the largest, if they differ)
    is_draft_group: bool
    layers: tuple[LayerCell, ...]


def describe_groups(groups: list, kv_cache_spec: Any | None = None) -> list[GroupRow]:
    """Plain rows for ``viz.kv_group_layout_figure``: one per group, one cell per layer."""
    markers = {}
    if kv_cache_spec is not None:
        markers = {name: spec.is_draft for name, spec in check_spec_dict(kv_cache_spec).items()}
    rows = []
    for i, group in enumerate(groups):
        per_layer = group_layer_specs(group)
        cells = tuple(
            LayerCell(name, spec_kind(per_layer[name]), markers.get(name, per_layer[name].is_draft),
                      per_layer[name].page_size_bytes)
            for name in group.layer_names
        )
        kinds = list(dict.fromkeys(c.kind for c in cells))
        rows.append(GroupRow(i, "+".join(kinds), group.kv_cache_spec.block_size,
                             max((c.page_size_bytes for c in cells), default=0), group.is_eagle_group, cells))
    return rows


def ungrouped_layers(groups: list, kv_cache_spec: Any) -> tuple[LayerCell, ...]:
    """The layers of ``kv_cache_spec`` that no group holds (vLLM's exact-partition check fails on them)."""
    specs = check_spec_dict(kv_cache_spec)
    held = {name for group in groups for name in group.layer_names}
    return tuple(LayerCell(name, spec_kind(spec), spec.is_draft, spec.page_size_bytes)
                 for name, spec in specs.items() if name not in held)


def format_groups(groups: list, kv_cache_spec: Any | None = None) -> str:
    """One line per group: kind, KV block size, page size, draft flag and short layer names."""
    lines = []
    for row in describe_groups(groups, kv_cache_spec):
        flag = "  <- draft group" if row.is_draft_group else ""
        names = ", ".join(c.short_name + ("*" if c.is_draft else "") for c in row.layers)
        lines.append(f"g{row.index} {row.kind:<16} {row.kv_block_size:>5} tok/block {row.page_size_bytes:>9,} B/page  "
                     f"[{names}]{flag}")
    return "\n".join(lines)


def short_layer_name(name: str) -> str:
    """'model.layers.7.self_attn.attn' -> 'L7', 'mtp.layers.0.self_attn.attn' -> 'mtp0', swa caches get ':swa'."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] == "layers" and parts[2].isdigit():
        prefix = "L" if parts[0] == "model" else parts[0]
        suffix = {"linear_attn": ":gdn", "swa_attn": ":swa"}.get(parts[-1], "")
        return f"{prefix}{parts[2]}{suffix}"
    return name


@dataclass(frozen=True)
class GroupMemory:
    group: int
    kind: str
    num_layers: int
    is_draft_group: bool
    kv_block_size: int  # tokens per KV page (Mamba: tokens per state block)
    page_size_bytes: int  # one layer's page
    bytes_per_block: int  # one block across all the group's layers
    bytes_per_token: float | None  # None for Mamba: its state does not grow with tokens
    pool_bytes_per_block: int  # stride of the shared block pool (set by the widest group)
    unused_bytes_per_block: int  # pool stride this group leaves empty (vLLM's padding)
    num_blocks: int  # blocks the budget buys in the shared pool
    tokens: int | None  # tokens the group holds if it owns every block (None for Mamba)


def group_memory(groups: list, *, layout: str = "LBHNC", kv_budget_bytes: int = 1 << 30) -> list[GroupMemory]:
    """Per-group memory for a KV budget, with vLLM's own block accounting.

    All groups draw blocks from one pool; vLLM sizes a block by the widest group
    (``get_kv_cache_config_from_groups``), so a narrower group leaves part of every
    block it owns empty.
    """
    budget = positive_int(kv_budget_bytes, "kv_budget_bytes", "arguments")
    if not groups:
        raise ValueError("groups is empty: nothing to size")
    v = vllm_api()
    config = v.planning.get_kv_cache_config_from_groups(
        grouping_config(layout_name(layout), False), groups, budget
    )
    rows = [(g, group_layer_specs(g)) for g in groups]
    group_bytes = [sum(s.page_size_bytes for s in per_layer.values()) for _, per_layer in rows]
    if config.num_blocks == 0:
        raise ValueError(f"kv_budget_bytes={budget} is smaller than one block of the pool "
                         f"(>= {max(group_bytes):,} bytes)")
    pool = config.kv_cache_tensors[0].size // config.num_blocks
    memory = []
    for i, ((group, per_layer), nbytes) in enumerate(zip(rows, group_bytes)):
        is_mamba = group_holds_mamba(group)
        kv_block_size = group.kv_cache_spec.block_size  # vLLM's name for tokens per page
        memory.append(GroupMemory(
            group=i,
            kind="+".join(dict.fromkeys(spec_kind(s) for s in per_layer.values())),
            num_layers=len(group.layer_names),
            is_draft_group=group.is_eagle_group,
            kv_block_size=kv_block_size,
            page_size_bytes=max(s.page_size_bytes for s in per_layer.values()),
            bytes_per_block=nbytes,
            bytes_per_token=None if is_mamba else nbytes / kv_block_size,
            pool_bytes_per_block=pool,
            unused_bytes_per_block=pool - nbytes,
            num_blocks=config.num_blocks,
            tokens=None if is_mamba else config.num_blocks * kv_block_size,
        ))
    return memory
