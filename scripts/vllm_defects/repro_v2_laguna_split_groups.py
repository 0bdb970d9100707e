"""vLLM 0.33, V2 model runner: a Laguna DFlash drafter split over KV-cache groups stores its
context K/V with the first group's slot mapping only. CANDIDATE defect: shown on a CPU with
vLLM's own classes; nobody here has run it on a GPU.

Run with the lab's .venv (vLLM 0.33, its config and KV-cache code run on the CPU):

    VLLM_TARGET_DEVICE=cpu .venv/bin/python scripts/vllm_defects/repro_v2_laguna_split_groups.py [--json]

What it does, every step vLLM's own code:

1. ``get_kv_cache_groups`` groups a hybrid Laguna target (4 sliding + 2 full-attention
   layers) with a 4-layer full-attention DFlash drafter: the 6 full-attention layers are cut
   into two groups of 3, so the drafter's layers sit in two groups (kv_cache_planning.py:522-532).
2. V2's ``DFlashSpeculator.set_attn`` (v1/worker/gpu/spec_decode/dflash/speculator.py:246-312)
   runs on those groups, once with a drafter model that has ``get_draft_kv_cache_layer_names``
   (as ``DFlashQwen3ForCausalLM`` does, qwen3_dflash.py:793-799) and once with vLLM's
   ``DFlashLagunaForCausalLM`` class (laguna_dflash.py:238), which does not define it. The base
   class's ``set_attn`` (attention backends, metadata builders) is replaced by a no-op: it needs a
   GPU and plays no part in the mapping.
3. ``DFlashSpeculator._precompute_context_kv`` (:379-395) then hands the model its context
   slot mappings: a list with one row per drafter layer (each layer its own group's slots) in the
   first case, group 0's single row for every layer in the second.

The second case is the defect: the drafter's layers in group 1 would get their context K/V
written at group 0's slots, and attention over group 1's blocks would read other data. No error
is raised. Exit status 1 when the Laguna drafter gets one shared slot mapping, 0 otherwise.
"""

import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator  # noqa: E402

TARGET_TYPES = ["sliding", "sliding", "full", "sliding", "sliding", "full"]
DRAFTER_LAYERS = 4
N_CONTEXT = 5


def specs() -> dict:
    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    out = {}
    for i, kind in enumerate(TARGET_TYPES):
        spec = SlidingWindowSpec(**common, sliding_window=64) if kind == "sliding" else FullAttentionSpec(**common)
        out[f"model.layers.{i}.self_attn.attn"] = spec
    for j in range(DRAFTER_LAYERS):  # DFlashLagunaModel: layers.{j + target layer count}, full KV cache, marked
        out[f"model.layers.{len(TARGET_TYPES) + j}.self_attn.attn"] = FullAttentionSpec(**common, is_draft=True)
    return out


class CaptureContextSlots:
    """Stands in for the drafter's forward-side method; records what the speculator hands it."""

    def __init__(self, layer_names=None):
        self.seen = None
        if layer_names is not None:
            self.get_draft_kv_cache_layer_names = lambda: list(layer_names)

    def precompute_and_store_context_kv(self, states, positions, context_slot_mapping=None):
        self.seen = context_slot_mapping


def run_speculator(model, groups) -> list:
    """V2's set_attn and _precompute_context_kv on ``groups``; the slot rows each drafter layer gets."""
    spec = object.__new__(DFlashSpeculator)  # its __init__ allocates device buffers; set_attn sets what we read
    drafter_names = {n for n, s in specs().items() if s.is_draft}
    spec.attn_groups = [[SimpleNamespace(get_metadata_builder=lambda: SimpleNamespace())]
                        if drafter_names & set(g.layer_names) else [] for g in groups]
    spec.device, spec.max_num_tokens, spec.requires_non_causal = torch.device("cpu"), 16, True
    spec.model = model
    spec.hidden_states = torch.zeros(16, 8)
    spec.context_positions = torch.zeros(16, dtype=torch.int64)
    with mock.patch.object(DraftModelSpeculator, "set_attn", lambda *a, **k: None):
        DFlashSpeculator.set_attn(spec, None, SimpleNamespace(kv_cache_groups=groups), None, None, None)
    for i, gid in enumerate(spec.draft_kv_cache_group_ids):  # distinct slots per group, as block tables give
        spec._context_slot_mappings[i, :N_CONTEXT] = torch.arange(N_CONTEXT) + 1000 * gid
    DFlashSpeculator._precompute_context_kv(spec, 0, N_CONTEXT)
    seen = model.seen
    rows = seen if isinstance(seen, list) else [seen] * DRAFTER_LAYERS
    return [r.tolist() for r in rows]


def main() -> int:
    layer_specs = specs()
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves before grouping
    groups = get_kv_cache_groups(config, dict(layer_specs))
    drafter = [n for n, s in layer_specs.items() if s.is_draft]
    group_of = {n: gid for gid, g in enumerate(groups) for n in g.layer_names}
    needed = [[1000 * group_of[n] + t for t in range(N_CONTEXT)] for n in drafter]
    with_names = run_speculator(CaptureContextSlots(drafter), groups)
    laguna_model = CaptureContextSlots()
    assert not hasattr(DFlashLagunaForCausalLM, "get_draft_kv_cache_layer_names")
    laguna = run_speculator(laguna_model, groups)
    result = {
        "vllm": vllm.__version__,
        "drafter_layer_groups": [group_of[n] for n in drafter],
        "DFlashLagunaForCausalLM_defines_get_draft_kv_cache_layer_names":
            hasattr(DFlashLagunaForCausalLM, "get_draft_kv_cache_layer_names"),
        "slots_needed_per_layer": needed,
        "slots_with_layer_names": with_names,
        "slots_laguna": laguna,
        "laguna_layers_with_wrong_slots": [n for n, got, want in zip(drafter, laguna, needed) if got != want],
    }
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        print(f"vLLM {result['vllm']}: drafter layers in KV-cache groups {result['drafter_layer_groups']}")
        print("context slots each drafter layer needs:           ", needed)
        print("V2 hands a model with get_draft_kv_cache_layer_names:", with_names)
        print("V2 hands DFlashLagunaForCausalLM (no such method):   ", laguna)
        print("Laguna drafter layers written at another group's slots:", result["laguna_layers_with_wrong_slots"] or "none")
    return 1 if result["laguna_layers_with_wrong_slots"] else 0


if __name__ == "__main__":
    sys.exit(main())
