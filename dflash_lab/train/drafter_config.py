"""The drafter's training config: two attention recipes, every field checked, the drafter config it makes.

    ATTENTION_PRESETS    the DFlash paper's attention (full, non-causal) and Poolside's
                         (sliding window 64, causal), as published
    DrafterTrainConfig   one run's shape and schedule; ``from_preset`` is the one place a preset
                         meets the caller's options (the CLI and a notebook run both go through it),
                         and ``__post_init__`` checks every field, naming the one that is wrong
    make_drafter_config  the ``DFlashDrafterConfig`` a config trains, for a given target
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..config import DEFAULT_BLOCK_SIZE, LAYER_TYPES, DFlashDrafterConfig
from ..runtime import is_int
from ..target import target_layer_ids_spread
from .tokenizer import MASK_ID

# Two attention recipes, as published: the DFlash paper's drafters are
# full attention and non-causal inside the block; Poolside's (Laguna-*-DFlash) are sliding-window
# layers, which vLLM makes causal inside the block.
ATTENTION_PRESETS = {
    "paper": {"layer_type": "full_attention", "sliding_window": None, "causal": None},
    "poolside": {"layer_type": "sliding_attention", "sliding_window": 64, "causal": True},
}
DEFAULT_PRESET = "paper"  # what the dataclass's own attention fields say


def check_attention(layer_type: str, sliding_window: int | None, causal: bool | None) -> None:
    """The attention options make a drafter vLLM can serve: a window exactly for sliding layers."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"`layer_type` must be one of {list(LAYER_TYPES)}, got {layer_type!r}")
    if layer_type == "sliding_attention":
        if not is_int(sliding_window) or sliding_window < 1:
            raise ValueError(f"a sliding_attention drafter needs `sliding_window` >= 1, got {sliding_window!r}")
    elif sliding_window is not None:
        raise ValueError(f"`sliding_window` {sliding_window} only applies to sliding_attention layers, "
                         f"not {layer_type}")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"`causal` must be True, False or None (vLLM's rule by layer type), got {causal!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Every count and size is an integer (field -> its lowest value); every rate a finite number in its range.
_INTEGERS = {"num_layers": 1, "intermediate_size": 1, "num_aux_layers": 1, "block_size": 2, "anchors_per_seq": 1,
             "batch_size": 1, "steps": 1, "warmup": 0, "log_every": 1, "seed": 0}
_NUMBERS = {  # field -> (the range it must lie in, in words; the test)
    "lr": ("> 0", lambda v: v > 0),
    "lr_floor": ("in [0, 1] (a fraction of lr)", lambda v: 0 <= v <= 1),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "grad_clip": ("> 0", lambda v: v > 0),
    "gamma": ("> 0", lambda v: v > 0),
    "short_block_share": ("in [0, 1]", lambda v: 0 <= v <= 1),
}


@dataclass
class DrafterTrainConfig:
    num_layers: int = 3  # deeper drafts further; the shipped drafters have 3 (vLLM serves them in one KV group)
    intermediate_size: int = 768  # the MLP width (the shipped drafters were widened to 1024 later)
    layer_type: str = "full_attention"  # or "sliding_attention" (Poolside's drafters); one type for every layer
    sliding_window: int | None = None  # sliding layers only: keys a query sees (vLLM's window), e.g. 64
    causal: bool | None = None  # None: vLLM's rule (sliding layers causal, full ones not); True/False: written
    # into the config as dflash_config.causal, which vLLM reads first
    num_aux_layers: int = 4  # target layers the drafter reads, spread over the target's depth
    block_size: int = DEFAULT_BLOCK_SIZE  # 1 real token + block_size - 1 drafts per training block
    anchors_per_seq: int = 32  # blocks cut from each sequence of a batch
    batch_size: int = 128
    steps: int = 4000
    lr: float = 2e-3
    warmup: int = 200  # steps of linear warm-up; a short run asks for fewer
    lr_floor: float = 0.05  # the cosine ends at lr_floor * lr; a sitting that another one continues ends higher
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0  # position-weight decay (the DFlash paper's value for block 16)
    short_block_share: float = 0.0  # share of blocks cut to a random length 2..bs-1, so smaller blocks work too
    cache_target_features: bool = False  # run the frozen target once per sequence, not per step (small data only)
    train_only: tuple = ()  # name prefixes of the only parameters to train (e.g. ("fc",)); () trains every one
    log_every: int = 20
    seed: int = 0

    def __post_init__(self):  # the CLI builds this first, so a bad value fails before any data generation
        for name, lowest in _INTEGERS.items():
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"DrafterTrainConfig.{name} must be an integer, got {value!r}")
            if value < lowest:
                raise ValueError(f"DrafterTrainConfig.{name} must be >= {lowest}, got {value}")
        for name, (wanted, ok) in _NUMBERS.items():
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"DrafterTrainConfig.{name} must be a finite number, got {value!r}")
            if not ok(value):
                raise ValueError(f"DrafterTrainConfig.{name} must be {wanted}, got {value}")
        if self.short_block_share > 0 and self.block_size < 3:
            raise ValueError(f"DrafterTrainConfig.short_block_share {self.short_block_share} needs block_size >= 3 "
                             f"(a short block is 2..block_size-1 long), got block_size {self.block_size}")
        check_attention(self.layer_type, self.sliding_window, self.causal)
        if not isinstance(self.cache_target_features, bool):
            raise TypeError(f"DrafterTrainConfig.cache_target_features must be True or False, "
                            f"got {self.cache_target_features!r}")
        if isinstance(self.train_only, str) or not all(isinstance(p, str) and p for p in self.train_only):
            raise TypeError(f"DrafterTrainConfig.train_only must be a tuple of parameter-name prefixes, "
                            f"got {self.train_only!r}")
        self.train_only = tuple(self.train_only)

    @classmethod
    def from_preset(cls, name: str = DEFAULT_PRESET, **overrides) -> DrafterTrainConfig:
        """An ``ATTENTION_PRESETS`` recipe with ``overrides`` (any fields) on top; every other field its default.

        The preset's window belongs to its layer type: overriding ``layer_type`` drops it (a full-attention
        layer has no window) unless ``sliding_window`` is given too. ``causal=None`` given restores vLLM's rule.
        """
        if name not in ATTENTION_PRESETS:
            raise ValueError(f"attention preset {name!r} is unknown; expected one of {sorted(ATTENTION_PRESETS)}")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"DrafterTrainConfig has no field {sorted(unknown)}; "
                            f"its fields: {[f.name for f in fields(cls)]}")
        preset = dict(ATTENTION_PRESETS[name])
        if overrides.get("layer_type", preset["layer_type"]) != preset["layer_type"]:
            preset["sliding_window"] = None
        return cls(**{**preset, **overrides})


def make_drafter_config(target_config, cfg: DrafterTrainConfig) -> DFlashDrafterConfig:
    """A drafter for ``target_config``, shaped by cfg (checked when cfg was built): depth, MLP width, layer type,
    window, causality."""
    n = cfg.num_layers
    return DFlashDrafterConfig(
        hidden_size=target_config.hidden_size, num_hidden_layers=n,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.head_dim, intermediate_size=cfg.intermediate_size, layer_types=[cfg.layer_type] * n,
        draft_vocab_size=target_config.vocab_size,
        target_layer_ids=target_layer_ids_spread(target_config.num_hidden_layers, cfg.num_aux_layers),
        mask_token_id=MASK_ID, block_size=cfg.block_size, target_hidden_size=target_config.hidden_size,
        target_layer_count=target_config.num_hidden_layers, rms_norm_eps=target_config.rms_norm_eps,
        # Mask tokens differ only by position: rotate every channel, with a short-range theta (the same for
        # either layer type, so the paper's and Poolside's drafters differ in attention alone).
        rope_parameters={cfg.layer_type: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
        sliding_window=cfg.sliding_window, causal=cfg.causal,
        max_position_embeddings=target_config.max_position_embeddings,
    )
