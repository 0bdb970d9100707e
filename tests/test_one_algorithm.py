"""One algorithm, every backend: each shipped drafter through every decoding path gives the same run.

The lab decodes DFlash four ways: the eager loop (``speculative_generate``), the fast path at
batch 1 (``fast_generate``: static buffers, graphs on a GPU), the fast path batched over ragged
prompts (``fast_generate_batch``) and evaluation's replay over teacher-forced drafts
(``train.AcceptanceProbe``). All four draft through ``DFlashLagunaDrafter.forward`` (context
K/V beside the block or in slots), accept with ``sampling.greedy_accept_batch`` and count with
``SpecDecodeStats``. This file runs the matrix, in float32 on held-out prompts:

    drafters: the paper's (full attention, non-causal), the Poolside-style one (sliding window
              64, causal) and a third config vLLM can serve (sliding, NON-causal, window 8 <
              block 16: the symmetric window of ``_maybe_symmetrize_window``)
    paths:    eager, fast at batch 1, fast batched (2 and 8 prompts, ragged), evaluation

and asserts the same tokens and the same per-position counts everywhere. vLLM's own engine on
both shipped drafters is ``test_vllm_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.spec_decode import fast_generate, fast_generate_batch, speculative_generate
from dflash_lab.spec_decode.fast import generate as fast_decoder
from dflash_lab.train import AcceptanceProbe

MAX_NEW = 24
BLOCK = 16
LENGTHS = (64, 23, 57, 40, 31, 48, 17, 36)  # ragged: each prompt cut to its last n tokens
DRAFTERS = ["paper", "poolside", "sliding-noncausal-w8"]


def sliding_non_causal(poolside: DFlashLagunaDrafter, window: int = 8) -> DFlashLagunaDrafter:
    """The Poolside-style drafter's weights under a config vLLM reads as sliding, non-causal, window 8."""
    d = poolside.config.to_dict()
    d["sliding_window"] = window
    d["dflash_config"] = {**d["dflash_config"], "causal": False}
    drafter = DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(d)).to(torch.float32)
    drafter.load_state_dict(poolside.state_dict())
    return drafter.eval()


@pytest.fixture(scope="module")
def shipped():
    target, paper, tok = load_default_pair("cpu", dtype=torch.float32)
    poolside = load_default_pair("cpu", dtype=torch.float32, drafter="poolside")[1]
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:]) for p, n in zip(heldout_prompts(), LENGTHS)]
    drafters = {"paper": paper, "poolside": poolside, "sliding-noncausal-w8": sliding_non_causal(poolside)}
    return target, drafters, prompts


@pytest.fixture(scope="module", params=DRAFTERS)
def eager(request, shipped):
    """(name, drafter, the eager loop's result on every prompt): the reference every other path must equal."""
    target, drafters, prompts = shipped
    drafter = drafters[request.param]
    results = [speculative_generate(target, drafter, p, max_new_tokens=MAX_NEW, block_size=BLOCK) for p in prompts]
    return request.param, drafter, results


def counts(stats):
    return {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
            "per_position": stats.num_accepted_tokens_per_pos, "lengths": stats.acceptance_lengths}


def assert_same_runs(got, want, path):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.new_token_ids == w.new_token_ids, f"{path}, prompt {i}: tokens differ"
        assert counts(g.stats) == counts(w.stats), f"{path}, prompt {i}: counts differ"


def test_the_third_drafter_is_sliding_non_causal_with_a_window_inside_the_block(shipped):
    cfg = shipped[1]["sliding-noncausal-w8"].config
    assert (cfg.layer_type, cfg.is_causal, cfg.window) == ("sliding_attention", False, 8) and cfg.window < BLOCK
    assert (shipped[1]["poolside"].config.is_causal, shipped[1]["paper"].config.is_causal) == (True, False)


def test_every_eager_run_is_plain_greedy_decoding_with_drafts_accepted(shipped, eager):
    target, _, prompts = shipped
    name, _, results = eager
    plain = speculative_generate(target, None, prompts[0], max_new_tokens=MAX_NEW)  # no drafter: plain greedy
    assert results[0].new_token_ids == plain.new_token_ids and plain.stats.num_drafts == 0
    assert plain.stats.num_target_forwards == 1 + MAX_NEW - 1  # the prefill, then one forward per token
    assert sum(r.stats.num_accepted_tokens for r in results) > 0, f"{name}: a trained drafter must be accepted"
    # (every prompt's tokens are the target's greedy continuation: the evaluation test checks them against it)


def test_fast_path_at_batch_1_equals_the_eager_loop_and_reuses_one_decoder(shipped, eager):
    target, _, prompts = shipped
    name, drafter, want = eager
    fast_decoder.clear_decoder_cache()
    got = [fast_generate(target, drafter, p, max_new_tokens=MAX_NEW, block_size=BLOCK, cuda_graphs=False)
           for p in prompts]
    assert_same_runs(got, want, f"{name}, fast batch 1")
    assert len(fast_decoder._DECODERS[target]) == 1  # built once, reused for every prompt


@pytest.mark.parametrize("batch", [2, 8])
def test_fast_path_batched_over_ragged_prompts_equals_the_eager_loop(shipped, eager, batch):
    target, _, prompts = shipped
    name, drafter, want = eager
    got = []
    for i in range(0, len(prompts), batch):
        got += fast_generate_batch(target, drafter, prompts[i:i + batch], max_new_tokens=MAX_NEW, block_size=BLOCK,
                                   cuda_graphs=False)
    assert_same_runs(got, want, f"{name}, fast batch {batch}")


@pytest.fixture(scope="module")
def probe(shipped):
    """Evaluation's replay: the target's greedy continuations and features of every prompt, computed once."""
    target, _, prompts = shipped
    return AcceptanceProbe(target, [p.tolist() for p in prompts], max_new_tokens=MAX_NEW, max_block_size=BLOCK)


def test_evaluation_replay_counts_what_the_eager_loop_counts(probe, eager):
    name, drafter, want = eager
    for (g, P, _), r in zip(probe.items, want):
        assert g[P:P + MAX_NEW].tolist() == r.new_token_ids, f"{name}: the replay follows another continuation"
    merged = sum((r.stats for r in want))
    assert counts(probe(drafter, BLOCK)) == counts(merged), f"{name}, evaluation replay"


# ---------------------------------------------------------------------------
# GPU rows: the same matrix on CUDA, graphs on (run on the H200; CI skips them)
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", DRAFTERS)
def test_gpu_graphed_fast_path_equals_the_eager_loop_for_every_drafter(name):
    target, paper, tok = load_default_pair("cuda", dtype=torch.float32)
    poolside = load_default_pair("cuda", dtype=torch.float32, drafter="poolside")[1]
    drafter = {"paper": paper, "poolside": poolside}.get(name) or sliding_non_causal(poolside).cuda()
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:]).cuda() for p, n in zip(heldout_prompts(), LENGTHS)]
    want = [speculative_generate(target, drafter, p, max_new_tokens=MAX_NEW, block_size=BLOCK) for p in prompts]
    fast_decoder.clear_decoder_cache()
    one = [fast_generate(target, drafter, p, max_new_tokens=MAX_NEW, block_size=BLOCK) for p in prompts]
    assert fast_decoder.cached_decoder(target, drafter, batch=1, block_size=BLOCK,
                                       capacity=max(LENGTHS) + MAX_NEW).cuda_graphs, "graphs were not captured"
    assert_same_runs(one, want, f"{name}, graphed batch 1")
    for batch in (2, 8):
        got = []
        for i in range(0, len(prompts), batch):
            got += fast_generate_batch(target, drafter, prompts[i:i + batch], max_new_tokens=MAX_NEW, block_size=BLOCK)
        assert_same_runs(got, want, f"{name}, graphed batch {batch}")
