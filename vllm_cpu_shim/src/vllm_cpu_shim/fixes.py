"""Detect, then fix: each defect is probed on a tiny input before and after patching.

A fix is a (probe, patch, unpatch) triple. ``probe()`` returns None when vLLM
computes the right thing and a short description of the wrong result otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable

PLUGIN_NAME = "dflash_lab_cpu_shim"  # the entry-point name; VLLM_PLUGINS lists it to enable the shim
DISABLE_ENV = "VLLM_CPU_SHIM_DISABLE"  # comma-separated fix names to leave out (e.g. to watch a defect bite)

_applied: dict[str, str] = {}  # fix name -> what its probe saw before patching
_registered = False


# ---------------------------------------------------------------------------
# Defect 1: CPURouter refuses sigmoid scoring (Laguna's MoE) unless grouped top-k is on
# ---------------------------------------------------------------------------


def reference_sigmoid_topk(logits, bias, top_k: int, renormalize: bool = True):
    """transformers' Laguna routing: select top-k of sigmoid + bias; weigh by the UNBIASED sigmoid.

    Returns (weights (T, k), ids (T, k)) sorted by expert id, so that two results compare directly.
    """
    import torch

    scores = torch.sigmoid(logits.float())  # (T, E)
    ids = torch.topk(scores + (bias if bias is not None else 0), top_k, dim=-1).indices  # (T, k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    order = ids.argsort(-1)
    return weights.gather(1, order), ids.gather(1, order)


def _router_probe() -> str | None:
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    g = torch.Generator().manual_seed(0)
    tokens, experts, top_k = 5, 8, 2
    logits = torch.randn(tokens, experts, generator=g)
    bias = 0.5 * torch.randn(experts, generator=g)  # large enough to change which experts win
    router = CPURouter(top_k=top_k, global_num_experts=experts, renormalize=True, scoring_func="sigmoid",
                       e_score_correction_bias=bias)
    try:
        weights, ids = router._compute_routing(torch.zeros(tokens, 4), logits, None)
    except AssertionError as e:
        return f"CPURouter refuses scoring_func='sigmoid' (AssertionError{': ' + str(e) if str(e) else ''})"
    want_w, want_ids = reference_sigmoid_topk(logits, bias, top_k)
    order = ids.long().argsort(-1)
    got_w, got_ids = weights.float().gather(1, order), ids.long().gather(1, order)
    if not torch.equal(got_ids, want_ids) or not torch.allclose(got_w, want_w, atol=1e-6):
        return f"CPURouter's sigmoid top-k differs from transformers': ids {got_ids[0].tolist()} vs {want_ids[0].tolist()}"
    return None


def _router_patch() -> Callable[[], None]:
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    original = cpu_router.CPURouter._compute_routing

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.scoring_func == "sigmoid" and not self.use_grouped_topk and self.custom_routing_function is None:
            # Grouped top-k with ONE group is plain top-k: the bias only steers the
            # selection, the weights are the unbiased sigmoid scores, renormalised.
            return cpu_router._grouped_topk(
                gating_output=router_logits, topk=self.top_k, renormalize=self.renormalize,
                num_expert_group=1, topk_group=1, scoring_func="sigmoid",
                routed_scaling_factor=self.routed_scaling_factor,
                e_score_correction_bias=self.e_score_correction_bias)
        return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)

    _compute_routing.__wrapped__ = original
    cpu_router.CPURouter._compute_routing = _compute_routing

    def unpatch():
        cpu_router.CPURouter._compute_routing = original

    return unpatch


# ---------------------------------------------------------------------------
# Defect 2: the CPU rms_norm kernel ignores the grouped form DFlash's context K/V uses
# ---------------------------------------------------------------------------


def reference_grouped_rms_norm(x, weight, eps: float):
    """x (L, ..., H), weight (L, H): slice i normalised over H and scaled by weight row i (float32)."""
    import torch

    x = x.float()
    w = weight.float().reshape(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[-1])  # (L, 1.., H)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def grouped_rms_norm_errors(rms_norm) -> dict[str, list[float]]:
    """Max |rms_norm - reference| per layer, for the two grouped calls laguna_dflash makes.

    "expanded": the context norm, input (L, N, H) = one (N, H) tensor expanded (stride 0).
    "contiguous": the K-norm, input (L, N, nkv, hd) contiguous, weight (L, hd).
    """
    import torch

    g = torch.Generator().manual_seed(0)
    L, N, H, nkv, hd, eps = 3, 4, 32, 2, 16, 1e-6
    errors = {}
    ctx = torch.randn(N, H, generator=g)
    w_ctx = 0.5 + torch.rand(L, H, generator=g)
    out = torch.empty(L, N, H)
    rms_norm(out, ctx.unsqueeze(0).expand(L, -1, -1), w_ctx, eps)
    errors["expanded"] = (out - reference_grouped_rms_norm(ctx.expand(L, N, H), w_ctx, eps)).abs().flatten(1).amax(1)
    k = torch.randn(L, N, nkv, hd, generator=g)
    w_k = 0.5 + torch.rand(L, hd, generator=g)
    out = torch.empty_like(k)
    rms_norm(out, k, w_k, eps)
    errors["contiguous"] = (out - reference_grouped_rms_norm(k, w_k, eps)).abs().flatten(1).amax(1)
    return {name: e.tolist() for name, e in errors.items()}


def _rms_norm_probe() -> str | None:
    from vllm import _custom_ops as ops

    errors = grouped_rms_norm_errors(ops.rms_norm)
    bad = {name: e for name, e in errors.items() if not all(x <= 1e-5 for x in e)}  # NaN fails too
    if bad:
        return "grouped rms_norm max error per layer " + ", ".join(
            f"{name} [{', '.join(f'{x:.2g}' for x in e)}]" for name, e in bad.items())
    return None


def per_layer_rms_norm(plain):
    """``plain(out, input, weight, eps)`` extended to the grouped form: one plain call per layer.

    A 1-D (or None) weight goes straight to ``plain``. A 2-D weight (L, H) with
    input and out (L, ..., H) calls ``plain`` on slice i with weight row i, each
    input made contiguous (the kernel ignores strides).
    """
    import torch

    def rms_norm(out, input, weight, epsilon):
        if weight is None or weight.dim() == 1:
            return plain(out, input, weight, epsilon)
        if weight.dim() != 2 or input.dim() < 2 or not (weight.shape[0] == input.shape[0] == out.shape[0]) \
                or weight.shape[-1] != input.shape[-1] or out.shape != input.shape:
            raise ValueError(f"grouped rms_norm expects input and out (L, ..., H) and weight (L, H); got input "
                             f"{tuple(input.shape)}, out {tuple(out.shape)}, weight {tuple(weight.shape)}")
        for i in range(weight.shape[0]):
            target = out[i]
            dst = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
            plain(dst, input[i].contiguous(), weight[i].contiguous(), epsilon)
            if dst is not target:
                target.copy_(dst)

    rms_norm.__wrapped__ = plain
    return rms_norm


def _rms_norm_patch() -> Callable[[], None]:
    from vllm import _custom_ops as ops

    original = ops.rms_norm
    ops.rms_norm = per_layer_rms_norm(original)  # laguna_dflash / qwen3_dflash look up ops.rms_norm at call time

    def unpatch():
        ops.rms_norm = original

    return unpatch


# ---------------------------------------------------------------------------
# Defect 3: the CPU expand kernel of the rejection sampler never writes its output
# ---------------------------------------------------------------------------

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"  # the Triton kernel the CPU build overrides


def reference_expand(input_val, cu_num_tokens, replace_from, replace_to, num_tokens: int):
    """What vLLM's expand_kernel computes: request i's value (replace_from -> replace_to) on its tokens."""
    import torch

    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # tokens per request
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def expand_errors(expand) -> list[str]:
    """Run ``expand(output, input, cu_num_tokens, replace_from, replace_to)`` as the rejection sampler
    does (temperature: float32, 0 -> 1; top-k: int32) and list the wrong results."""
    import torch

    cu = torch.tensor([2, 5], dtype=torch.int32)  # request 0: 2 draft tokens, request 1: 3
    wrong = []
    for dtype, values, replace_from, replace_to in ((torch.float32, [0.0, 0.7], 0, 1), (torch.int32, [0, 5], 0, 9)):
        x = torch.tensor(values, dtype=dtype)
        out = torch.full((5,), -3, dtype=dtype)  # a sentinel the kernel must overwrite
        expand(out, x, cu, replace_from, replace_to)
        want = reference_expand(x, cu, replace_from, replace_to, 5)
        if not torch.equal(out, want):
            got = [float(f"{v:.3g}") for v in out.tolist()]
            wrong.append(f"{str(dtype).removeprefix('torch.')} {values} -> {got} instead of "
                         f"{[float(f'{v:.3g}') for v in want.tolist()]}")
    return wrong


def _expand_probe() -> str | None:
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C, where the CPU kernel lives)
    from vllm.utils import cpu_triton_utils

    wrong = expand_errors(cpu_triton_utils._expand_kernel_impl)
    return "CPU expand kernel: " + "; ".join(wrong) if wrong else None


def cpu_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vLLM's expand_kernel in torch: output[tokens of request i] = input_val[i] (replace_from -> replace_to)."""
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = reference_expand(input_val, cu_num_tokens, replace_from, replace_to, total).to(output.dtype)


def _expand_patch() -> Callable[[], None]:
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils._expand_kernel_impl
    # The worker registers the CPU overrides right after loading plugins and reads this attribute then.
    cpu_triton_utils._expand_kernel_impl = cpu_expand
    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is not None and registered[1] is original:  # registered before this plugin ran
        dispatcher.register_kernels({EXPAND_KERNEL: cpu_expand})

    def unpatch():
        cpu_triton_utils._expand_kernel_impl = original
        if registered is not None and registered[1] is original:
            dispatcher.register_kernels({EXPAND_KERNEL: original})

    return unpatch


# ---------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    name: str
    what: str  # one line for the log
    probe: Callable[[], str | None]
    patch: Callable[[], Callable[[], None]]

    def apply_if_needed(self) -> bool:
        """Probe; patch when broken; probe again and undo the patch unless it now passes."""
        try:
            before = self.probe()
        except Exception as e:  # a probe that cannot run says nothing about the defect: leave vLLM alone
            _log(logging.WARNING, "probe for %s failed (%s: %s); not patching", self.name, type(e).__name__, e)
            return False
        if before is None:
            _log(logging.DEBUG, "%s works in this vLLM; no fix needed", self.name)
            return False
        unpatch = self.patch()
        try:
            after = self.probe()
        except Exception as e:
            after = f"{type(e).__name__}: {e}"
        if after is not None:
            unpatch()
            _log(logging.WARNING, "the fix for %s did not help (%s); left vLLM unpatched", self.name, after)
            return False
        _applied[self.name] = before
        _log(logging.INFO, "applied fix for %s: %s (detected: %s)", self.name, self.what, before)
        return True


FIXES = (
    Fix("cpu-router-sigmoid", "sigmoid(+bias) top-k routed through grouped top-k with one group",
        _router_probe, _router_patch),
    Fix("grouped-rms-norm", "grouped ops.rms_norm split into one plain rms_norm per layer",
        _rms_norm_probe, _rms_norm_patch),
    Fix("cpu-expand-kernel", "rejection sampler's per-token expand (temperature, top-k, top-p) done in torch",
        _expand_probe, _expand_patch),
)


def _log(level: int, msg: str, *args) -> None:
    """Through vLLM's logger once vLLM has configured logging; else one plain line on stderr.

    (vLLM configures logging after some processes load plugins; a record logged
    before that would be dropped.)
    """
    from vllm.logger import init_logger

    logger = init_logger(f"vllm.plugins.{PLUGIN_NAME}")
    if logger.hasHandlers():
        logger.log(level, msg, *args)
    elif level >= logging.INFO:
        print(f"{logging.getLevelName(level)} {PLUGIN_NAME}: {msg % args}", file=sys.stderr, flush=True)


def applied_fixes() -> dict[str, str]:
    """Fix name -> the defect its probe detected, for the fixes applied in this process."""
    return dict(_applied)


def register() -> None:
    """vLLM's plugin hook: runs once per process; acts only on vLLM's CPU platform."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # a GPU (or other) install is never touched
        return
    disabled = {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}
    unknown = disabled - {fix.name for fix in FIXES}
    if unknown:
        _log(logging.WARNING, "%s names unknown fixes %s (known: %s)", DISABLE_ENV, sorted(unknown),
             [fix.name for fix in FIXES])
    for fix in FIXES:
        if fix.name in disabled:
            _log(logging.WARNING, "fix for %s disabled by %s", fix.name, DISABLE_ENV)
        else:
            fix.apply_if_needed()
