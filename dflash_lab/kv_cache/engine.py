"""What vLLM 0.33's engine itself does with the KV-cache groups, run through vLLM's own code.

``groups`` applies upstream #55390's rules on top of vLLM's grouping. This module
runs, for comparison, the path an engine takes in 0.33 without them (``groups`` calls it
for ``rules="vllm-0.33"``; this module takes vLLM's grouping from ``grouping``, never from ``groups``):

    partition   ``get_kv_cache_groups_from_builder`` asserts that every grouping
                partitions the layers exactly (``_check_exact_partition``,
                ``kv_cache_planning.py:1203-1230``), before anything is annotated
    annotation  ``get_global_kv_cache_groups``: only when the method needs the
                last-block drop, flag the groups holding ``is_draft`` layers and warn
                when a hybrid's draft group is not found (``kv_cache_planning.py:1650-1656``)
    the drop    which methods drop the last block of a prefix-cache hit: vLLM's own
                ``SpeculativeConfig`` predicates, and the scheduler turning the drop off
                where lookahead block hashes cover the next token instead
                (``sched/scheduler.py:331, 342-345``)

The engine's config is a default ``VllmConfig`` with two stand-ins: the speculative
config (``grouping.speculative_config_stub``, vLLM's predicates on a plain object) and
a model config saying the model brings no grouping of its own (no model in 0.33 does).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from types import SimpleNamespace
from typing import Any, NamedTuple

from dflash_lab.kv_cache.grouping import check_method, grouping_config, layout_name, speculative_config_stub
from dflash_lab.kv_cache.common import check_spec_dict, vllm_api, vllm_version

# vLLM's planning module logs its draft-group warning under this name.
VLLM_PLANNING_LOGGER = "vllm.v1.core.kv_cache_planning"


class BlockDrop(NamedTuple):
    """vLLM 0.33's answers for one method (prefix caching on, no KV connector)."""
    method: str
    use_eagle: bool  # EAGLE family: reads the target's hidden states, keeps a draft KV cache
    needs_eagle_block_drop: bool  # its draft K/V at a position depends on the next token
    use_eagle_block_drop: bool  # ... and the drop is not switched off
    num_hash_lookahead_tokens: int  # > 0: block hashes cover the next token(s) instead
    drops_last_block: bool  # what the scheduler hands the KV-cache manager as ``use_eagle``


def _engine_config(method: str | None, layout: str, hybrid_manager_disabled: bool, **stub_fields):
    # A shallow copy: it shares the cached config's sub-configs, which nothing here writes.
    config = copy.copy(grouping_config(layout_name(layout), bool(hybrid_manager_disabled)))
    config.speculative_config = None if method is None else speculative_config_stub(method, **stub_fields)
    config.model_config = SimpleNamespace(supports_kv_cache_grouping=False)
    return config


def block_drop(method: str, *, disable_lookahead_block_hashes: bool = False) -> BlockDrop:
    """Whether ``method`` drops the last block of a prefix-cache hit in vLLM 0.33, from vLLM's own predicates."""
    method = check_method(method)
    if method is None:
        raise ValueError("method is None: block_drop needs a speculative method")
    config = _engine_config(method, "LBHNC", False, disable_lookahead_block_hashes=disable_lookahead_block_hashes)
    spec = config.speculative_config
    lookahead = config.num_hash_lookahead_tokens  # VllmConfig's property (vllm.py:678-692)
    drop = spec.use_eagle_block_drop() and not lookahead  # the scheduler: lookahead hashes clear the drop
    return BlockDrop(method, spec.use_eagle(), spec.needs_eagle_block_drop(), spec.use_eagle_block_drop(),
                     lookahead, drop)


@contextlib.contextmanager
def vllm_draft_group_warnings():
    """Collect vLLM's draft-group warnings (its planning logger) as strings, printing nothing."""
    messages: list[str] = []
    vllm_logger = logging.getLogger(VLLM_PLANNING_LOGGER)

    class _Collect(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "draft model" in text:  # not vLLM's padding notes
                messages.append(text)

    handler, level, propagate = _Collect(level=logging.WARNING), vllm_logger.level, vllm_logger.propagate
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.WARNING)  # a notebook may have quieted "vllm" as a whole
    vllm_logger.propagate = False
    try:
        yield messages
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
        vllm_logger.propagate = propagate


def engine_kv_cache_groups(
    kv_cache_spec: Any,
    *,
    method: str | None,
    layout: str = "LBHNC",
    hybrid_manager_disabled: bool = False,
) -> tuple[list, list[str]]:
    """vLLM 0.33's ``get_global_kv_cache_groups`` for one worker: the groups as the engine
    annotates them, and vLLM's own draft-group warnings.

    No #55390: the marker rule runs only where ``use_eagle_block_drop()``; nothing else flags.
    """
    specs = check_spec_dict(kv_cache_spec)
    config = _engine_config(check_method(method), layout, hybrid_manager_disabled)
    with vllm_draft_group_warnings() as warned:
        try:
            groups = vllm_api().planning.get_global_kv_cache_groups(config, [dict(specs)])
        except (AssertionError, NotImplementedError, TypeError, ValueError) as exc:
            raise ValueError(
                f"vLLM {vllm_version()} cannot group these layers (layout={layout}, "
                f"hybrid_manager_disabled={bool(hybrid_manager_disabled)}): {type(exc).__name__}: {exc}"
            ) from exc
    return groups, warned


class _GivenGroups:
    """A stand-in ``KVCacheConfigBuilder`` whose grouping is the groups it was given."""

    def __init__(self, groups: list):
        self.groups = groups

    def get_kv_cache_groups(self, vllm_config, kv_cache_spec):
        return self.groups


def partition_check(kv_cache_spec: Any, groups: list) -> str | None:
    """Run ``groups`` through vLLM 0.33's ``get_kv_cache_groups_from_builder``, which every
    grouping passes before annotation: None if vLLM accepts them, else its assertion message.

    vLLM asserts no layer sits in two groups and none is missing; a name the spec does not
    have passes this check (the lab's ``groups_partition_layers_exactly`` rejects it too).
    """
    specs = check_spec_dict(kv_cache_spec)
    try:
        vllm_api().planning.get_kv_cache_groups_from_builder(_GivenGroups(groups), grouping_config("LBHNC", False),
                                                             dict(specs))
    except AssertionError as exc:
        return str(exc)
    return None
