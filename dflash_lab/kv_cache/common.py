"""What every module of ``kv_cache`` shares: vLLM, imported on first use, and the checks of their arguments.

    vllm_api         vLLM's KV-cache classes, config and grouping functions, imported once and only
                     when asked for (the rest of the lab imports without vLLM)
    check_spec_dict  a layer name -> KV-cache spec dict, every name and spec checked
    positive_int, torch_dtype   argument readers whose errors name the argument
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from dflash_lab.runtime import is_int

INSTALL_HINT = (
    'the KV-cache grouping needs vLLM 0.33: install it with `pip install "vllm==0.33.*"` '
    "(or run `make setup`, which installs every dependency of the lab)"
)


# ---------------------------------------------------------------------------
# vLLM, imported on first use
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def vllm_api() -> SimpleNamespace:
    """vLLM's KV-cache classes and grouping functions (imported once, lazily).

    Every module of ``kv_cache`` reaches vLLM through this.
    """
    # Grouping is host-side bookkeeping: run it on vLLM's CPU platform unless the
    # user picked another one.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Imported here, not at the top: vLLM is a heavy optional dependency (seconds to
    # import, platform probing). The rest of the lab must import without it, and only
    # the KV-cache chapter pays for it, with an ImportError that says how to install it.
    try:
        import vllm
        from vllm.config import SpeculativeConfig, VllmConfig
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
        from vllm.v1 import kv_cache_interface
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.core import kv_cache_planning
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (importing vLLM failed: {exc})") from exc
    return SimpleNamespace(
        version=vllm.__version__,
        VllmConfig=VllmConfig,
        SpeculativeConfig=SpeculativeConfig,
        iface=kv_cache_interface,
        planning=kv_cache_planning,
        MambaStateShapeCalculator=MambaStateShapeCalculator,
        GDN=MambaAttentionBackendEnum.GDN_ATTN,
        KVCacheLayout=KVCacheLayout,
    )


def vllm_version() -> str:
    """The installed vLLM's version (imports vLLM; raises ImportError with the fix if missing)."""
    return vllm_api().version


# ---------------------------------------------------------------------------
# Checking the arguments
# ---------------------------------------------------------------------------


def check_spec_dict(kv_cache_spec: Any, *, argument: str = "kv_cache_spec") -> dict[str, Any]:
    """A name -> spec dict from a mapping or (name, spec) pairs; names unique and non-empty."""
    spec_cls = vllm_api().iface.KVCacheSpec
    if isinstance(kv_cache_spec, Mapping):
        pairs = list(kv_cache_spec.items())
    elif isinstance(kv_cache_spec, Iterable) and not isinstance(kv_cache_spec, (str, bytes)):
        pairs = list(kv_cache_spec)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise TypeError(f"{argument} must be a mapping of layer name -> KVCacheSpec or (name, spec) pairs")
    else:
        raise TypeError(f"{argument} must be a mapping of layer name -> KVCacheSpec, "
                        f"got {type(kv_cache_spec).__name__}")
    if not pairs:
        raise ValueError(f"{argument} is empty: there are no layers to group")
    specs: dict[str, Any] = {}
    for name, spec in pairs:
        if not isinstance(name, str):
            raise TypeError(f"{argument}: layer name {name!r} is not a string")
        if not name.strip():
            raise ValueError(f"{argument}: a layer name is empty ({name!r})")
        if name in specs:
            raise ValueError(f"{argument}: layer name {name!r} appears twice; every layer registers once")
        if not isinstance(spec, spec_cls):
            raise TypeError(f"{argument}[{name!r}] must be a vLLM KVCacheSpec, got {type(spec).__name__}")
        specs[name] = spec
    return specs


def positive_int(value: Any, key: str, where: str) -> int:
    """``value`` if it is an integer >= 1; errors name ``key`` and ``where`` it came from."""
    if not is_int(value):
        raise TypeError(f"{where}: `{key}` must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}: `{key}` must be >= 1, got {value}")
    return value


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a torch dtype (a name such as 'bfloat16', or the dtype itself); errors name it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float16', 'float32')")
    return value
