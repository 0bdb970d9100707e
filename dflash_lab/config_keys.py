"""The drafter config keys vLLM 0.33 reads in more than one way, resolved as vLLM resolves them.

vLLM reads a drafter directory through transformers' ``LagunaConfig`` (``get_config``), then
each Laguna attention layer picks its own RoPE entry (``model_executor/models/laguna.py``
:365-400, in ``LagunaAttention.__init__``) and ``get_rope`` fills in what the entry leaves out
(``layers/rotary_embedding/__init__.py``:63-72). The target's aux hidden states come from
``get_eagle3_aux_layers_from_config`` (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``
:113-148) while ``DFlashLagunaModel`` sizes ``fc`` from ``dflash_config.target_layer_ids``
(``laguna_dflash.py``:78-83). Nothing here imports vLLM: ``tests/test_vllm_config_path.py``
builds vLLM's own drafter on the same dicts and checks every answer.

The keys, in the order a layer reads them:

    rope_parameters        nested ``{layer_type: entry}``: the layer's entry, else the
                           ``full_attention`` entry, else nothing; flat: the one dict
    swa_rope_parameters    a sliding layer takes this dict instead, when present
    partial_rotary_factor  (top level) added to the entry when the entry has none
    rope_dim               (in the entry) the rotated channels, overriding the factor
    rotary_pct, rotary_emb_fraction   older names of the top-level factor: vLLM's
                           ``patch_rope_parameters`` takes the first of partial_rotary_factor,
                           rotary_pct, rotary_emb_fraction (``transformers_utils/config.py``:675-683)
    swa_attention_sink_enabled   a learned sink per head on sliding layers (:354-358, :485-488)
    eagle_aux_hidden_state_layer_ids / dflash_config.target_layer_ids   the layer ids
    dflash_config.mask_token_id, else a top-level mask_token_id (and the other methods' names
                           after it), as ``get_parallel_drafting_token_id``
                           (``v1/worker/gpu/spec_decode/utils.py``:92-114)
"""

from __future__ import annotations

from .runtime import is_int

LAYER_TYPES = ("full_attention", "sliding_attention")

# Laguna's own defaults (transformers' LagunaConfig): full-attention layers rotate
# half of each head with a long-context theta, sliding layers rotate all of it.
DEFAULT_ROPE_PARAMETERS = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
# What get_rope assumes for a key the entry leaves out.
GET_ROPE_DEFAULTS = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
# The top-level rotary factor under the names vLLM reads, first present wins.
PARTIAL_ROTARY_KEYS = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
# Where the mask token id is read, in vLLM's order (dflash_config's own key first).
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
SINK_KEY = "swa_attention_sink_enabled"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
IDS_KEY = "dflash_config.target_layer_ids"


def top_partial_rotary(d: dict) -> tuple[object, str | None]:
    """The top-level rotary factor and the key it came from, by vLLM's aliases (None, None: absent)."""
    for key in PARTIAL_ROTARY_KEYS:
        if d.get(key) is not None:
            return d[key], key
    return None, None


def mask_token_key(d: dict, dflash: dict) -> tuple[dict, str, str]:
    """(where, key, name for errors) of the mask token id, read as vLLM 0.33 reads it.

    ``dflash_config.mask_token_id`` when the key is there, else a top-level ``mask_token_id``
    (not null), else ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id``
    (``v1/worker/gpu/spec_decode/utils.py``:99-109; V1: ``llm_base_proposer.py``:362-373).
    Nothing found: ``dflash_config.mask_token_id`` is reported missing.
    """
    if "mask_token_id" in dflash:
        return dflash, "mask_token_id", "dflash_config.mask_token_id"
    if d.get("mask_token_id") is not None:
        return d, "mask_token_id", "mask_token_id"
    for key in MASK_TOKEN_KEYS[1:]:  # vLLM's hasattr: present counts, even as null (then refused)
        if key in d:
            return d, key, key
    return dflash, "mask_token_id", "dflash_config.mask_token_id"


def transformers_rope_parameters(d: dict) -> dict:
    """``config.rope_parameters`` as transformers' ``LagunaConfig`` leaves it for ``d`` (flat or nested).

    A flat ``rope_theta`` with no ``rope_parameters`` is not moved anywhere: the Laguna
    defaults stand for both layer types, whatever the file's value.
    """
    from transformers import LagunaConfig  # heavy import, only where a config is read

    keys = ("rope_parameters", "rope_theta", "partial_rotary_factor", "layer_types", "num_hidden_layers",
            "head_dim", "hidden_size", "num_attention_heads")
    kwargs = {k: d[k] for k in keys if k in d}
    top, _ = top_partial_rotary(d)  # vLLM's patch_rope_parameters renames an older alias before standardising
    if top is not None:
        kwargs["partial_rotary_factor"] = top
    return dict(LagunaConfig(**kwargs).rope_parameters or {})


def layer_rope(d: dict, layer_type: str) -> tuple[dict, str, str | None]:
    """The RoPE dict a ``layer_type`` layer hands to vLLM's ``get_rope``, where it came from,
    and where its ``partial_rotary_factor`` came from (None: get_rope's default 1.0)."""
    top = transformers_rope_parameters(d)
    if any(isinstance(v, dict) for v in top.values()):
        picked = next((t for t in (layer_type, "full_attention") if top.get(t)), None)
        entry, origin = ((dict(top[picked]), f"rope_parameters.{picked}") if picked
                         else ({}, "nothing (get_rope's defaults)"))
    else:
        entry, origin = dict(top), "rope_parameters (flat)"
    swa = d.get("swa_rope_parameters")
    if layer_type == "sliding_attention" and swa is not None:
        entry, origin = dict(swa), "swa_rope_parameters"
    partial_from = origin if "partial_rotary_factor" in entry else None
    top, top_key = top_partial_rotary(d)
    if top is not None and "partial_rotary_factor" not in entry:
        entry["partial_rotary_factor"] = top
        partial_from = f"{top_key} (top level)"
    if "rope_dim" in entry:
        partial_from = f"{origin}.rope_dim"
    return entry, origin, partial_from


def served_rope(entry: dict, head_dim: int) -> dict:
    """``entry`` with get_rope's defaults filled in; ``rope_dim`` (if any) becomes the factor it means."""
    out = {**GET_ROPE_DEFAULTS, **{k: v for k, v in entry.items() if k in GET_ROPE_DEFAULTS}}
    if "rope_dim" in entry:
        out["partial_rotary_factor"] = entry["rope_dim"] / head_dim
    return out


def _file_rope_entry(d: dict, layer_type: str) -> dict:
    """What the file itself spells for ``layer_type`` (before any reader): the most specific key wins."""
    swa = d.get("swa_rope_parameters")
    if layer_type == "sliding_attention" and isinstance(swa, dict):
        return swa
    nested = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    entry = nested.get(layer_type) if isinstance(nested.get(layer_type), dict) else nested
    return {"rope_theta": entry.get("rope_theta", d.get("rope_theta")),
            "partial_rotary_factor": entry.get("partial_rotary_factor", top_partial_rotary(d)[0])}


def rope_resolution_table(d: dict) -> list[dict]:
    """Per layer type: theta and rotary factor as the file spells them, as vLLM runs them, which
    key supplied them, and whether the two differ."""
    head_dim = d.get("head_dim") or (d.get("hidden_size", 128) // max(1, d.get("num_attention_heads", 1)))
    rows = []
    for t in LAYER_TYPES:
        entry, origin, partial_from = layer_rope(d, t)
        served = served_rope(entry, head_dim)
        in_file = _file_rope_entry(d, t)
        theta, factor = in_file.get("rope_theta"), in_file.get("partial_rotary_factor")
        differs = (theta is not None and float(theta) != served["rope_theta"]) or \
            (factor is not None and float(factor) != served["partial_rotary_factor"])
        # With no rope_parameters in the file, the entries are LagunaConfig's defaults: say so.
        default = "" if isinstance(d.get("rope_parameters"), dict) else " (LagunaConfig's default)"
        mark = lambda key: key + default if key.startswith("rope_parameters") else key  # noqa: E731
        rows.append({"layer_type": t, "rope_theta_in_file": theta, "rope_theta_served": float(served["rope_theta"]),
                     "partial_rotary_in_file": factor, "partial_rotary_factor": float(served["partial_rotary_factor"]),
                     "rope_from": mark(origin), "partial_rotary_from": mark(partial_from or "get_rope's default (1.0)"),
                     "differs": bool(differs)})
    return rows


def target_layer_ids(d: dict, dflash: dict, err) -> list[int]:
    """The target layers whose outputs feed the drafter, ascending, read as vLLM 0.33 reads them.

    - ``eagle_aux_hidden_state_layer_ids``, when non-empty, names what the target captures
      (an empty list counts as absent, ``eagle3_utils.py:120``); otherwise
      ``dflash_config.target_layer_ids`` + 1 does. Id L is the hidden state entering layer L.
    - ``dflash_config.target_layer_ids`` must be there and non-empty in any case:
      ``DFlashLagunaModel`` sizes ``fc`` from it (``laguna_dflash.py:78-83``).
    - The target collects ids in ascending layer order, so an unsorted list is sorted.
    The lab refuses two things vLLM lets through: the keys naming different layers (vLLM would
    capture the aux ids and size ``fc`` by the other list), and aux id 0 (the embedding output,
    which vLLM captures before layer 0, ``laguna.py:656-658``; the lab captures layer outputs only).
    ``err(key, message, exc=ConfigError)`` builds the error.
    """
    if "target_layer_ids" not in dflash or dflash["target_layer_ids"] is None:
        raise err(IDS_KEY, f"is missing: vLLM's DFlashLagunaModel reads it (laguna_dflash.py:78) even when "
                  f"`{AUX_KEY}` is set")
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise err(IDS_KEY, f"must be a list of integers, got {ids!r}", TypeError)
    if not ids:
        raise err(IDS_KEY, "is empty: the drafter needs at least one target layer", ValueError)
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise err(IDS_KEY, f"must be distinct non-negative layer indices, got {ids}")
    aux = d.get(AUX_KEY)
    if not aux:  # None, [] (or another empty value): vLLM falls back to target_layer_ids + 1
        return sorted(ids)
    if not isinstance(aux, list) or not all(is_int(i) for i in aux):
        raise err(AUX_KEY, f"must be a list of integers, got {aux!r}", TypeError)
    if 0 in aux:
        raise err(AUX_KEY, f"{aux} holds id 0, the embedding output: vLLM 0.33 captures it (laguna.py:656-658), "
                  "but the lab's target captures layer outputs only (ids >= 1)")
    if any(i < 0 for i in aux) or len(set(aux)) != len(aux):
        raise err(AUX_KEY, f"must be distinct layer ids >= 1 (id L = the hidden state entering layer L), got {aux}")
    if sorted(aux) != sorted(i + 1 for i in ids):
        raise err(AUX_KEY, f"{aux} disagrees with `{IDS_KEY}` {ids}: vLLM captures {AUX_KEY} (it wins) but sizes fc "
                  f"by {IDS_KEY}; the lab expects {AUX_KEY} = {IDS_KEY} + 1, i.e. {[i + 1 for i in ids]}")
    return sorted(ids)


def check_attention_sinks(d: dict, layer_type: str, err) -> None:
    """``swa_attention_sink_enabled``: vLLM 0.33 gives sliding layers a learned sink per head
    (``laguna.py:354-358, 485-488``). The lab's drafter has no sinks, so it refuses a sliding
    drafter with the key on rather than run without them; on full-attention layers vLLM ignores it."""
    value = d.get(SINK_KEY)
    if value is not None and not isinstance(value, bool):
        raise err(SINK_KEY, f"must be true or false, got {value!r}", TypeError)
    if value and layer_type == "sliding_attention":
        raise err(SINK_KEY, "is true: vLLM 0.33 then adds a learned attention sink per head to every sliding "
                  "layer (laguna.py:354-358, 485-488); the lab's drafter has no attention sinks, so it "
                  "refuses this config instead of running it without them", NotImplementedError)


def config_key_table(d: dict) -> list[dict]:
    """One row per key of this module: its value in ``d``, what vLLM 0.33 does with it, what the lab does."""
    types = d.get("layer_types") or ["full_attention"]
    sliding = types[0] == "sliding_attention"
    dflash = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    missing = object()

    def row(key, value, vllm, lab):
        return {"key": key, "in_file": "absent" if value is missing else value, "vllm": vllm, "lab": lab}

    swa, partial = d.get("swa_rope_parameters", missing), d.get("partial_rotary_factor", missing)
    sink = d.get(SINK_KEY, missing)
    aux, ids = d.get(AUX_KEY, missing), dflash.get("target_layer_ids", missing)
    rope = {r["layer_type"]: r for r in rope_resolution_table(d)}[types[0]]
    return [
        row("swa_rope_parameters", swa,
            "the RoPE of sliding layers (laguna.py:380-394)" if sliding else "ignored: full_attention layers",
            f"the same: {types[0]} runs theta {rope['rope_theta_served']:g} from {rope['rope_from']}"),
        row("partial_rotary_factor", partial, "added to a RoPE entry that has none (laguna.py:398-400)",
            f"the same: {rope['partial_rotary_factor']:g} from {rope['partial_rotary_from']}"),
        row(SINK_KEY, sink, "a learned sink per head on sliding layers (laguna.py:354-358)" if sliding
            else "ignored: full_attention layers", "refused (no sinks in the lab's drafter)" if sliding and sink is True
            else "nothing to do"),
        row(AUX_KEY, aux, "wins when non-empty; empty = absent (eagle3_utils.py:120); id 0 = embeddings",
            "the same, but refuses id 0 and a list that disagrees with target_layer_ids + 1"),
        row(IDS_KEY, ids, "required and non-empty; its length sizes fc (laguna_dflash.py:78-83)",
            "the same: refused when missing or empty"),
    ]
