"""Will vLLM keep the drafter's layers in one KV-cache group? If not, serve with the hybrid manager off.

vLLM's DFlash proposer (like every eagle-family proposer) asserts that all
drafter attention layers belong to ONE KV-cache group. With a hybrid target
(sliding + full layers) vLLM's grouping cuts each attention type into groups
of equal size, and the layer counts alone decide where the cut falls: the
shipped 6-layer target (4 sliding, 2 full) with a 4-layer full-attention
drafter has 6 full-attention layers, which vLLM cuts into two groups of 3 (one
target layer and two drafter layers each), so vLLM's engine refuses to start ("All drafting layers should belong
to the same kv cache group"). Chapter 4 draws these groups.

With ``--disable-hybrid-kv-cache-manager`` vLLM turns every sliding-window
spec into a full-attention one and puts all layers in one group; the sliding
layers still attend inside their window (vLLM: "the compute of layers like
sliding window is still saved"), so outputs do not change, only the sliding
layers' pages are no longer freed early. The lab asks vLLM's own grouping
(vLLM 0.33, in the lab's ``.venv``) which case a pair is in and passes the
flag only where the drafter would be split.
"""

from __future__ import annotations

import json
from pathlib import Path


def drafter_kv_groups(target_dir, drafter_dir, *, hybrid_manager_disabled: bool = False) -> list[list[str]]:
    """The drafter layers of each vLLM KV-cache group that holds any (vLLM 0.33's get_kv_cache_groups)."""
    from ..kv_cache import groups as kv_groups, specs as kv_specs

    target = json.loads((Path(target_dir) / "config.json").read_text())
    drafter = json.loads((Path(drafter_dir) / "config.json").read_text())
    specs = kv_specs.laguna_dflash_specs(target, drafter)
    drafter_layers = list(specs)[target["num_hidden_layers"]:]
    groups = kv_groups.vllm_kv_cache_groups(specs, hybrid_manager_disabled=hybrid_manager_disabled)
    return [[name for name in group.layer_names if name in drafter_layers] for group in groups
            if set(group.layer_names) & set(drafter_layers)]


def needs_hybrid_manager_disabled(target_dir, drafter_dir) -> bool:
    """True when vLLM's hybrid grouping would split the drafter's layers over more than one group."""
    return len(drafter_kv_groups(target_dir, drafter_dir)) > 1
