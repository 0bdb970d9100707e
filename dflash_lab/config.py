"""The drafter's config.json, validated the way vLLM 0.33 validates it.

A Laguna DFlash drafter checkpoint carries an HF-style ``config.json``:

    {"architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna",
     "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768,
     "layer_types": ["full_attention", ...], "rope_parameters": {...},
     "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 3,
                       "block_size": 16},
     "draft_vocab_size": 4096, ...}

``DFlashDrafterConfig.from_dict`` enforces vLLM's rules (``laguna_dflash.py``):
``layer_types`` present, one per layer and uniform; ``target_layer_ids``
non-empty; ``draft_vocab_size`` present. The keys vLLM reads in more than one way
(RoPE per layer type, ``swa_rope_parameters``, a top-level ``partial_rotary_factor``,
``swa_attention_sink_enabled``, the two layer-id keys) are resolved in ``config_keys``
exactly as vLLM 0.33 resolves them, or refused. Every error names the key (and the
file, when the config came from one).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config_keys import (  # noqa: F401  (re-exported: the lab's readers of vLLM's keys)
    DEFAULT_ROPE_PARAMETERS,
    LAYER_TYPES,
    check_attention_sinks,
    config_key_table,
    layer_rope,
    mask_token_key,
    rope_resolution_table,
    target_layer_ids,
    top_partial_rotary,
)
from .runtime import is_int

ARCHITECTURE = "DFlashLagunaForCausalLM"
GATING_CHOICES = (True, False, "per-head", "per-element")


class ConfigError(ValueError):
    """A config value is missing or wrong; the message names the key (and file)."""


def read_json(file: Path):
    """The parsed JSON in ``file``; a ConfigError naming the file when it is not JSON text."""
    try:
        return json.loads(Path(file).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text: {e.reason}") from None


DEFAULT_BLOCK_SIZE = 16  # 1 real token + 15 drafts: the paper's block and the shipped drafters'


@dataclass
class DFlashDrafterConfig:
    hidden_size: int  # must equal the target's: embeddings and lm_head are shared
    num_hidden_layers: int  # drafter depth; 1-5 in published DFlash drafters
    num_attention_heads: int
    num_key_value_heads: int  # GQA: the context K/V store holds only these heads
    head_dim: int
    intermediate_size: int  # dense SiLU MLP; drafter layers are never MoE
    layer_types: list[str]  # uniform: all full_attention or all sliding_attention
    draft_vocab_size: int  # == target vocabulary (the lm_head is the target's)
    target_layer_ids: list[int]  # target layers whose outputs feed the drafter, ascending (vLLM's order)
    mask_token_id: int  # fills positions 1.. of every block
    block_size: int = DEFAULT_BLOCK_SIZE  # the largest block the drafter was trained for
    target_hidden_size: int | None = None  # fc input is this x len(target_layer_ids)
    target_layer_count: int | None = None  # drafter attention layer j is named target_layer_count + j
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_ROPE_PARAMETERS)))
    sliding_window: int | None = None  # a compute-time limit; the K/V store stays full
    causal: bool | None = None  # explicit is_causal / dflash_config.causal; None: vLLM's default by layer type
    gating: bool | str = True  # softplus output gate: True/"per-head" or "per-element"
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    source: str | None = field(default=None, repr=False, compare=False)  # file it came from

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size

    # --- derived sizes -------------------------------------------------------
    @property
    def layer_type(self) -> str:
        return self.layer_types[0]

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "sliding_attention"

    @property
    def rope(self) -> dict:
        """RoPE parameters of the drafter's (single) layer type."""
        return self.rope_parameters[self.layer_type]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", 1.0)))

    @property
    def gate_per_head(self) -> bool:
        return self.gating is True or self.gating == "per-head"

    @property
    def is_causal(self) -> bool:
        """Causal inside the draft block? vLLM's `_dflash_layer_causal`, first match wins:
        `is_causal` / `dflash_config.causal` when set, else causal exactly for sliding layers.
        (Laguna drafters have uniform layer types, so one answer holds for every layer.)"""
        return self.causal if self.causal is not None else self.is_sliding

    @property
    def aux_hidden_state_layer_ids(self) -> list[int]:
        """vLLM's `eagle_aux_hidden_state_layer_ids`: hidden state *entering* layer t+1 = output of layer t."""
        return [i + 1 for i in self.target_layer_ids]

    @property
    def window(self) -> int | None:
        """The attention window a query sees, or None for full attention."""
        return self.sliding_window if self.is_sliding else None

    # --- reading -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, *, source: str | None = None) -> "DFlashDrafterConfig":
        where = f" in {source}" if source else ""
        if not isinstance(d, dict):
            raise ConfigError(f"drafter config{where} must be a JSON object, got {type(d).__name__}")

        def err(key: str, msg: str, exc=ConfigError):
            return exc(f"drafter config{where}: `{key}` {msg}")

        archs = d.get("architectures")
        if archs is not None and ARCHITECTURE not in (archs if isinstance(archs, list) else [archs]):
            raise err("architectures", f"must contain {ARCHITECTURE!r}, got {archs!r}")

        def get_int(key, *, src=d, name=None, minimum=1, required=True, default=None):
            name = name or key
            if key not in src or src[key] is None:
                if required:
                    raise err(name, "is missing")
                return default
            v = src[key]
            if not is_int(v):
                raise err(name, f"must be an integer, got {v!r}", TypeError)
            if v < minimum:
                raise err(name, f"must be >= {minimum}, got {v}")
            return v

        hidden = get_int("hidden_size")
        n_layers = get_int("num_hidden_layers")
        n_heads = get_int("num_attention_heads")
        n_kv = get_int("num_key_value_heads")
        if n_heads % n_kv:
            raise err("num_attention_heads", f"({n_heads}) must be divisible by num_key_value_heads ({n_kv})")
        head_dim = get_int("head_dim", required=False, default=None) or hidden // n_heads
        inter = get_int("intermediate_size")

        # vLLM's _get_dflash_layer_types: present, one per layer, uniform.
        layer_types = d.get("layer_types")
        if layer_types is None:
            raise err("layer_types", "is missing: a Laguna DFlash config requires `layer_types`", ValueError)
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise err("layer_types", f"must be a list of strings, got {layer_types!r}", TypeError)
        if len(layer_types) != n_layers:
            raise err("layer_types", f"has length {len(layer_types)}, which does not match num_hidden_layers "
                      f"{n_layers}", ValueError)
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise err("layer_types", f"holds unknown types {unknown}; expected {list(LAYER_TYPES)}")
        if len(set(layer_types)) > 1:
            raise NotImplementedError(
                f"drafter config{where}: `layer_types` must be uniform for a Laguna DFlash drafter "
                f"(all full_attention or all sliding_attention); got {sorted(set(layer_types))}"
            )

        if d.get("draft_vocab_size") is None:
            raise err("draft_vocab_size", "is missing: Laguna DFlash shares the target lm_head and requires it",
                      ValueError)
        vocab = get_int("draft_vocab_size")

        dflash = d.get("dflash_config")
        if not isinstance(dflash, dict):
            raise err("dflash_config",
                      "is missing or not an object" if dflash is None else f"must be an object, got {dflash!r}")
        ids = target_layer_ids(d, dflash, err)
        mask_src, mask_key, mask_name = mask_token_key(d, dflash)  # dflash_config's, else the top level's
        mask_id = get_int(mask_key, src=mask_src, name=mask_name, minimum=0)
        if mask_id >= vocab:
            raise err(mask_name, f"({mask_id}) is outside the vocabulary (draft_vocab_size {vocab})")
        block = dflash.get("block_size", d.get("block_size", DEFAULT_BLOCK_SIZE))
        if not is_int(block) or block < 2:
            raise err("dflash_config.block_size", f"must be an integer >= 2, got {block!r}")

        rope = d.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise err("rope_parameters", f"must be an object, got {rope!r}", TypeError)
        if "rope_theta" in d and not _positive_number(d["rope_theta"]):
            raise err("rope_theta", f"must be a positive number, got {d['rope_theta']!r}")
        swa = d.get("swa_rope_parameters")
        if swa is not None and not isinstance(swa, dict):
            raise err("swa_rope_parameters", f"must be an object, got {swa!r}", TypeError)
        top_factor, top_key = top_partial_rotary(d)  # partial_rotary_factor, or vLLM's older names for it
        if top_factor is not None and not (_positive_number(top_factor) and top_factor <= 1):
            raise err(top_key, f"must be in (0, 1], got {top_factor!r}")
        # What vLLM serves: LagunaConfig's rope_parameters, then the layer's own pick
        # (its entry, swa_rope_parameters, a top-level partial_rotary_factor): config_keys.
        own, origin, _ = layer_rope(d, layer_types[0])
        if own.get("rope_type", "default") != "default":
            raise err(f"{origin}.rope_type", f"{own.get('rope_type')!r} is not supported (only 'default')")
        if "rope_dim" in own:
            rope_dim = own["rope_dim"]
            if not is_int(rope_dim) or not 0 < rope_dim <= head_dim:
                raise err(f"{origin}.rope_dim", f"must be an integer in 1..head_dim ({head_dim}), got {rope_dim!r}")
            own = {**own, "partial_rotary_factor": rope_dim / head_dim}
        factor = own.get("partial_rotary_factor", 1.0)
        theta = own.get("rope_theta", 10000.0)
        factor_key = top_key if factor is top_factor else f"{origin}.partial_rotary_factor"
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise err(factor_key, f"must be in (0, 1], got {factor!r}")
        if int(head_dim * factor) % 2:
            raise err(factor_key, f"gives an odd rotary dim {int(head_dim * factor)} for head_dim {head_dim}")
        if not _positive_number(theta):
            raise err(f"{origin}.rope_theta", f"must be a positive number, got {theta!r}")
        rope = {layer_types[0]: {"rope_type": "default", "rope_theta": float(theta),
                                 "partial_rotary_factor": float(factor)}}
        check_attention_sinks(d, layer_types[0], err)

        # transformers' LagunaConfig (and so vLLM) takes an int or no key at all: `null` is refused.
        if "sliding_window" in d and d["sliding_window"] is None:
            raise err("sliding_window", "is null, which vLLM cannot read (transformers' LagunaConfig wants an "
                      "integer): leave the key out for a full-attention drafter", TypeError)
        window = get_int("sliding_window", required=layer_types[0] == "sliding_attention")
        causal = _explicit_causal(d, dflash, err)

        gating = d.get("gating", True)
        if gating not in GATING_CHOICES or isinstance(gating, (int, float)) and not isinstance(gating, bool):
            raise err("gating", f"must be one of {list(GATING_CHOICES)}, got {gating!r}")
        eps = d.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise err("rms_norm_eps", f"must be a small positive number, got {eps!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise err("hidden_act", f"must be 'silu' (Laguna's MLP), got {act!r}")

        return cls(
            hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=n_kv, head_dim=head_dim, intermediate_size=inter,
            layer_types=list(layer_types), draft_vocab_size=vocab, target_layer_ids=list(ids),
            mask_token_id=mask_id, block_size=block,
            target_hidden_size=get_int("target_hidden_size", required=False, default=None),
            target_layer_count=get_int("target_layer_count", required=False, minimum=0,
                                       default=get_int("num_target_layers", src=dflash, required=False, minimum=1,
                                                       name="dflash_config.num_target_layers")),
            rms_norm_eps=float(eps), rope_parameters=rope, sliding_window=window, causal=causal, gating=gating,
            attention_bias=bool(d.get("attention_bias", False)), hidden_act=act,
            max_position_embeddings=get_int("max_position_embeddings", required=False, default=4096),
            source=source,
        )

    @classmethod
    def from_pretrained(cls, path) -> "DFlashDrafterConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no drafter config at {file}")
        return cls.from_dict(read_json(file), source=str(file))

    # --- writing -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """HF-style config.json that vLLM 0.33's DFlashLagunaForCausalLM reads.

        Absent values are left out, never written as null (vLLM refuses a null window);
        both layer-id keys are written, and agree.
        """
        d = asdict(self)
        for key in ("source", "target_layer_ids", "mask_token_id", "block_size", "causal"):
            d.pop(key)
        if d["sliding_window"] is None:
            d.pop("sliding_window")
        if d["target_layer_count"] is None:
            d.pop("target_layer_count")
        dflash = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                  "block_size": self.block_size}
        if self.causal is not None:
            dflash["causal"] = self.causal
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "laguna",
            **d,
            "vocab_size": self.draft_vocab_size,  # vLLM sizes the (shared) embedding from this
            "mlp_layer_types": ["dense"] * self.num_hidden_layers,  # vLLM's Laguna layer reads it
            "num_attention_heads_per_layer": [self.num_attention_heads] * self.num_hidden_layers,
            "eagle_aux_hidden_state_layer_ids": self.aux_hidden_state_layer_ids,
            "dflash_config": dflash,
            "block_size": self.block_size,
        }

    # --- pairing with a target -------------------------------------------------
    def validate_against_target(self, target_config) -> None:
        """Check that this drafter can serve ``target_config`` (a LagunaConfig or dict)."""
        if isinstance(target_config, dict):
            get = target_config.get
        else:
            def get(key):
                return getattr(target_config, key, None)
        where = f" ({self.source})" if self.source else ""
        vocab, n_layers, hidden = get("vocab_size"), get("num_hidden_layers"), get("hidden_size")
        if vocab is None or n_layers is None or hidden is None:
            raise ConfigError("target config must define vocab_size, num_hidden_layers and hidden_size")
        if self.draft_vocab_size != vocab:
            raise ConfigError(
                f"drafter{where} `draft_vocab_size` {self.draft_vocab_size} != target vocab_size {vocab}: "
                "Laguna DFlash shares the target's lm_head"
            )
        bad = [i for i in self.target_layer_ids if i >= n_layers]
        if bad:
            raise ConfigError(
                f"drafter{where} `dflash_config.target_layer_ids` {bad} do not exist in a target "
                f"with {n_layers} layers (valid: 0..{n_layers - 1})"
            )
        if self.mask_token_id >= vocab:
            raise ConfigError(f"drafter{where} `dflash_config.mask_token_id` {self.mask_token_id} is outside the "
                              f"target vocabulary ({vocab})")
        if self.target_hidden_size != hidden:
            raise ConfigError(
                f"drafter{where} `fc` expects target hidden size {self.target_hidden_size} "
                f"(x{len(self.target_layer_ids)} layers), but the target's hidden_size is {hidden}"
            )
        if self.hidden_size != hidden:
            raise ConfigError(
                f"drafter{where} `hidden_size` {self.hidden_size} != target hidden_size {hidden}: "
                "the drafter uses the target's embeddings and lm_head"
            )
        if self.target_layer_count is not None and self.target_layer_count != n_layers:
            raise ConfigError(
                f"drafter{where} `target_layer_count` {self.target_layer_count} != target num_hidden_layers {n_layers}"
            )


# ---------------------------------------------------------------------------
# Small readers (the keys vLLM reads in more than one way are in config_keys)
# ---------------------------------------------------------------------------


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _explicit_causal(d: dict, dflash: dict, err) -> bool | None:
    """`is_causal` and `dflash_config.causal` (vLLM checks them in that order); None when neither is set."""
    found = {}
    for name, value in (("is_causal", d.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
        if value is not None:
            if not isinstance(value, bool):
                raise err(name, f"must be true or false, got {value!r}", TypeError)
            found[name] = value
    if len(set(found.values())) > 1:
        raise err("is_causal", f"({found['is_causal']}) disagrees with `dflash_config.causal` "
                  f"({found['dflash_config.causal']}); vLLM would take `is_causal`: set one, or both alike")
    return next(iter(found.values()), None)
