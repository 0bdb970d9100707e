"""Run vLLM's offline engine (``vllm.LLM``) on token-id prompts; write outputs and spec-decode counters as JSON.

Executed with ``.venv-vllm``'s Python (vLLM's CPU build), NOT inside the lab's
environment: it imports only the standard library and vLLM, never dflash_lab.
The lab side (``dflash_lab.vllm_engine.offline``) writes the job file, starts
this script and reads the result back:

    .venv-vllm/bin/python dflash_lab/vllm_engine/offline_runner.py JOB.json RESULT.json

JOB.json:
    target                   checkpoint directory
    dtype, max_model_len, kv_cache_memory_bytes, enforce_eager, seed
    runs                     list of {name, prompts (token-id lists, given as vllm.inputs.TokensPrompt:
                             no tokenizer involved), method: "dflash" | "ngram" | null,
                             drafter (checkpoint directory, null without one), num_speculative_tokens,
                             temperature, max_new_tokens, draft_sample_method, prompt_lookup_min,
                             prompt_lookup_max, disable_hybrid_kv_cache_manager (one KV-cache group for
                             all layers; see kv_grouping.py)}; each run starts its own engine
                             (the speculative config is fixed per engine), one after the other
RESULT.json:
    vllm_version, shim (fixes applied in this process, or null when the shim is not loaded)
    runs: {name, outputs (generated token ids per prompt), steps (per prompt: [drafted, accepted]
           per verification step, vLLM's per-request spec-decode metrics), metrics_before /
           metrics_text (the spec-decode lines of the Prometheus exposition, scraped before and
           after generate), engine_start_s, generate_s}
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

SPEC_DECODE_PREFIX = "vllm:spec_decode_"


def spec_decode_exposition() -> str:
    """The spec-decode metric families of this process's Prometheus registry, in /metrics text format.

    ``LLM`` records its stats in the process-global registry (what the OpenAI
    server serves at /metrics); only the speculative-decoding families are kept.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    class Filtered:  # a collector view of REGISTRY holding only vllm:spec_decode_* families
        def collect(self):
            return [m for m in REGISTRY.collect() if m.name.startswith(SPEC_DECODE_PREFIX)]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Filtered())
    return generate_latest(registry).decode()


def speculative_config(run: dict, drafter: str | None) -> dict | None:
    method = run.get("method")
    if method is None:
        return None
    config = {"method": method, "num_speculative_tokens": int(run["num_speculative_tokens"])}
    if method == "dflash":
        config["model"] = drafter
        config["draft_sample_method"] = run.get("draft_sample_method", "greedy")
    elif method == "ngram":
        config["prompt_lookup_min"] = int(run.get("prompt_lookup_min", 2))
        config["prompt_lookup_max"] = int(run.get("prompt_lookup_max", 5))
    else:
        raise ValueError(f"run {run.get('name')!r}: method must be 'dflash', 'ngram' or null, got {method!r}")
    return config


def run_one(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=job["target"],
        skip_tokenizer_init=True,  # prompts and outputs are token ids
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len", 512)),
        kv_cache_memory_bytes=int(job.get("kv_cache_memory_bytes", 512 * 2**20)),  # not a RAM share
        enforce_eager=bool(job.get("enforce_eager", True)),
        disable_hybrid_kv_cache_manager=bool(run.get("disable_hybrid_kv_cache_manager", False)),
        seed=int(job.get("seed") or 0),
        speculative_config=speculative_config(run, run.get("drafter")),
        disable_log_stats=False,  # the spec-decode counters are stats
        per_request_spec_decode_metrics="detailed" if run.get("method") else "none",  # accepted/drafted per step
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the lab) engine and worker run in this
        # process: no spawned process re-imports vLLM, which costs ~20 s each on a 2-core machine.
        distributed_executor_backend="uni" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else None,
    )
    engine_start_s = time.perf_counter() - t0
    seed = run.get("seed", job.get("seed"))  # None: vLLM's global generator, no per-request one
    params = [SamplingParams(temperature=float(run.get("temperature", 0.0)), max_tokens=int(run["max_new_tokens"]),
                             ignore_eos=True, detokenize=False,
                             seed=None if seed is None else int(seed) + i)  # prompt i: seed + i, like the lab
              for i in range(len(run["prompts"]))]
    prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in run["prompts"]]
    before = spec_decode_exposition() if run.get("method") else ""
    t1 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t1
    after = spec_decode_exposition() if run.get("method") else ""
    outputs = [list(r.outputs[0].token_ids) for r in results]
    steps = []  # per prompt: [[drafted, accepted] per verification step], in order
    for r in results:
        m = r.outputs[0].spec_decode_metrics
        steps.append([[d, a] for d, a in zip(m.per_step_drafted, m.per_step_accepted)] if m is not None else None)
    llm.llm_engine.engine_core.shutdown()  # the engine core is a child process: stop it before the next run
    del llm
    gc.collect()
    return {"name": run["name"], "outputs": outputs, "steps": steps, "metrics_before": before, "metrics_text": after,
            "engine_start_s": round(engine_start_s, 2), "generate_s": round(generate_s, 3)}


def shim_status():
    """Fixes the CPU shim applied in this process; None when vLLM did not load it (VLLM_PLUGINS)."""
    try:
        import vllm_cpu_shim
        from vllm_cpu_shim.fixes import PLUGIN_NAME
    except ImportError:
        return None
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return None
    return vllm_cpu_shim.applied_fixes()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    import vllm
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what the engine core does too; makes shim_status() report this process
    runs = []
    # ngram runs last: its proposer loads numba, and a later engine in the same process then dies
    # re-registering vLLM's CPU kernel overrides (triton_utils/dispatcher.py _rebind_kernels calls
    # vars(x).get on every module attribute, and llvmlite's _lib_fn_wrapper breaks it).
    for run in sorted(job["runs"], key=lambda r: r.get("method") == "ngram"):
        runs.append(run_one(job, run))
        print(f"OFFLINE_RUNNER_DONE {run['name']}", flush=True)  # the lab's progress bar reads this line
    result = {"vllm_version": vllm.__version__, "shim": shim_status(), "runs": runs}
    tmp = f"{result_path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)  # the lab reads either a whole result or none
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this module
    sys.exit(main(sys.argv[1:]))
