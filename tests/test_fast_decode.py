"""The static, graphed decode path (spec_decode.fast.decoder) gives the eager loop's greedy output.

CPU: the static forward against transformers', the fast path against
``speculative_generate`` token for token and counter for counter (float32),
ragged batches, stops, and the fused norm kernels in Triton's interpreter.
GPU (marked ``gpu``): CUDA-graphed output equals ``target.generate`` in float32,
graphed equals the same kernels launched eagerly, and a step never syncs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.spec_decode import speculative_generate
from dflash_lab.measure.decoding import phase_times
from dflash_lab.spec_decode.fast.decoder import FastDecoder
from dflash_lab.spec_decode.fast.generate import fast_generate, fast_generate_batch
from dflash_lab.spec_decode.fast.cuda_graphs import GraphedStep
from dflash_lab.spec_decode.fast.static_target import StaticTarget
from dflash_lab.target import build_target, target_forward, tiny_laguna_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def small_target(layers=4):
    """A small hybrid Laguna: sliding window 8, so every generation crosses the window."""
    cfg = tiny_laguna_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        sliding_window=8, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, max_position_embeddings=256)
    return build_target(cfg, seed=0).float()


def small_drafter(target, seed=1):
    c = target.config
    cfg = DFlashDrafterConfig(
        hidden_size=c.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, layer_types=["full_attention"] * 2, draft_vocab_size=c.vocab_size,
        target_layer_ids=[0, c.num_hidden_layers - 1], mask_token_id=3, block_size=8,
        target_layer_count=c.num_hidden_layers)
    torch.manual_seed(seed)
    return DFlashLagunaDrafter(cfg).eval()


PROMPTS = [[5, 17, 99, 230, 17, 99], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411], [42] * 3]


@pytest.fixture(scope="module")
def small_pair():
    target = small_target()
    return target, small_drafter(target)


@pytest.fixture(scope="module")
def shipped():
    """The shipped pair in float32 on the CPU and four held-out prompts of different lengths."""
    from dflash_lab.assets import heldout_prompts, load_default_pair

    target, drafter, tok = load_default_pair("cpu", dtype=torch.float32)
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:]) for p, n in zip(heldout_prompts()[:4], (64, 40, 57, 23))]
    return target, drafter, prompts


def counters(stats):
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos,
            stats.acceptance_lengths, stats.num_generated_tokens, stats.num_target_forwards)


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("moe", ["dense", "grouped"])
def test_static_forward_matches_transformers_forward(small_pair, moe):
    target, _ = small_pair
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    with torch.no_grad():
        ref = target_forward(target, ids, [0, 3], past_key_values=DynamicCache())
        st = StaticTarget(target, batch=1, capacity=40, layer_ids=[0, 3], moe=moe)
        pos = torch.arange(30)[None]
        st.forward(ids[:, :20], pos[:, :20])  # a prefill, then a block on top of the static cache
        logits, aux = st.forward(ids[:, 20:], pos[:, 20:])
    torch.testing.assert_close(logits, ref.logits[:, 20:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref.aux_hidden[:, 20:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("proposer,block_size", [("dflash", 4), ("dflash", 8), ("ngram", 8), ("ngram_gpu", 8),
                                                   (None, 1)])
def test_fast_path_is_the_eager_loop_token_for_token(small_pair, proposer, block_size):
    target, drafter = small_pair
    drafter = drafter if proposer == "dflash" else proposer
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        r = fast_generate(target, drafter, ids, max_new_tokens=30, block_size=block_size, cuda_graphs=False)
        assert torch.equal(r.output_ids, expected)
        if drafter is not None:
            eager = speculative_generate(target, drafter, ids, max_new_tokens=30, block_size=block_size)
            assert counters(r.stats) == counters(eager.stats)


# The shipped drafters over ragged batches against the eager loop: tests/test_one_algorithm.py.


@pytest.mark.parametrize("name", ["paper", "poolside"])
def test_a_block_above_the_trained_one_runs_on_the_fast_path_as_on_the_eager_loop(shipped, name):
    """vLLM never reads dflash_config.block_size for DFlash (num_speculative_tokens decides): both backends run a
    block of 20 with drafters trained on 16, give the target's greedy tokens and count alike."""
    from dflash_lab.assets import load_default_pair

    target, drafter, prompts = shipped
    drafter = drafter if name == "paper" else load_default_pair("cpu", dtype=torch.float32, drafter=name)[1]
    block = drafter.config.block_size + 4
    for p in prompts[:2]:
        eager = speculative_generate(target, drafter, p[None], max_new_tokens=24, block_size=block)
        fast = fast_generate(target, drafter, p[None], max_new_tokens=24, block_size=block, cuda_graphs=False)
        plain = target.generate(p[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(fast.output_ids, plain) and torch.equal(eager.output_ids, plain)
        assert counters(fast.stats) == counters(eager.stats) and len(fast.stats.num_accepted_tokens_per_pos) == block - 1


def test_stop_tokens_end_each_sequence_like_the_eager_loop(shipped):
    target, drafter, prompts = shipped
    eager = [speculative_generate(target, drafter, p[None], max_new_tokens=30, block_size=8) for p in prompts[:3]]
    stop = [eager[0].new_token_ids[6], eager[2].new_token_ids[11]]
    fast = fast_generate_batch(target, drafter, prompts[:3], max_new_tokens=30, block_size=8, cuda_graphs=False,
                               stop_token_ids=stop)
    for p, r in zip(prompts[:3], fast):
        e = speculative_generate(target, drafter, p[None], max_new_tokens=30, block_size=8, stop_token_ids=stop)
        assert torch.equal(r.output_ids, e.output_ids)
        assert counters(r.stats) == counters(e.stats)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 17])
def test_max_new_tokens_is_exact(shipped, max_new_tokens):
    target, drafter, prompts = shipped
    r = fast_generate(target, drafter, prompts[1], max_new_tokens=max_new_tokens, block_size=16, cuda_graphs=False)
    assert r.stats.num_generated_tokens == max_new_tokens == len(r.new_token_ids)


def test_phase_times_cover_every_phase(shipped):
    target, drafter, prompts = shipped
    dec = FastDecoder(target, drafter, batch=1, block_size=8, capacity=128, cuda_graphs=False, phase_graphs=True)
    t = phase_times(dec, prompts[:1], max_new_tokens=12)
    assert t["steps"] >= 1 and all(t[f"{p}_s"] > 0 for p in ("draft", "verify", "append", "accept"))


def test_prompts_are_prefilled_padded_to_a_step_and_the_pads_are_never_seen(small_pair):
    # Each batch is prefilled at its longest prompt rounded up to PREFILL_STEP (one graph per
    # width on CUDA). Lengths on both sides of a step boundary, alone and together, give
    # target.generate's tokens and the eager loop's counts: no pad's K/V is ever attended.
    from dflash_lab.spec_decode.fast.decoder import PREFILL_STEP

    target, drafter = small_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 500, (n,), generator=g) for n in (PREFILL_STEP - 1, PREFILL_STEP, PREFILL_STEP + 1, 130)]
    dec = FastDecoder(target, drafter, batch=4, block_size=8, capacity=130 + 24, cuda_graphs=False)
    together = dec.generate(prompts, max_new_tokens=24)
    assert set(dec.prefills) == {(4, dec.prefill_width(130))}  # (rows filled, padded width) -> one graph
    for p, r in zip(prompts, together):
        alone = dec.generate([p], max_new_tokens=24)[0]
        expected = target.generate(p[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        eager = speculative_generate(target, drafter, p[None], max_new_tokens=24, block_size=8)
        assert torch.equal(r.output_ids, expected) and torch.equal(alone.output_ids, expected)
        assert counters(r.stats) == counters(alone.stats) == counters(eager.stats)
    alone_widths = sorted(w for n, w in dec.prefills if n == 1)
    assert alone_widths == [PREFILL_STEP, 2 * PREFILL_STEP, min(3 * PREFILL_STEP, dec.tgt.capacity)]
    assert dec.prefill_width(10_000) == dec.tgt.capacity  # never past the cache


def test_generation_ends_at_max_position_embeddings_as_on_the_eager_loop(small_pair):
    """Eager and fast paths agree at the length limit: both stop there (vLLM: max_model_len), drafts near it
    clamped so that block positions stay below it; the same tokens and the same counts."""
    target, drafter = small_pair
    max_pos = target.config.max_position_embeddings
    prompt = torch.randint(10, 500, (max_pos - 37,), generator=torch.Generator().manual_seed(5))
    for d in (drafter, "ngram", None):
        block = None if d is None else 8
        fast = fast_generate(target, d, prompt, max_new_tokens=300, block_size=block, cuda_graphs=False)
        eager = speculative_generate(target, d, prompt[None], max_new_tokens=300, block_size=block)
        assert fast.output_ids.shape[1] == max_pos and torch.equal(fast.output_ids, eager.output_ids)
        if d is not None:  # (no drafter: the eager loop's block is 2, the fast path's 1)
            assert counters(fast.stats) == counters(eager.stats)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fast_generate(target, drafter, torch.randint(10, 500, (max_pos + 1,)), max_new_tokens=4)
    with pytest.raises(ValueError, match="block_size"):  # a block above the trained one runs (vLLM's rule); one of 1 cannot
        FastDecoder(target, drafter, batch=1, block_size=1, capacity=64, cuda_graphs=False)


def test_a_graphed_step_off_cuda_is_a_plain_call():
    calls = []
    step = GraphedStep(lambda: calls.append(1), enabled=True, device=torch.device("cpu"))
    step()
    step()
    assert not step.captured and calls == [1, 1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("warm", [True, False])
def test_gpu_a_captured_step_is_replayed_once_then_reset(monkeypatch, warm):
    """With ``WARM_REPLAY`` the graph's first replay (which also uploads it) happens at capture: the call ran its
    warm-ups and that replay, and the state is reset after; the next call is an ordinary replay."""
    from dflash_lab.spec_decode.fast import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WARM_REPLAY", warm)
    runs, resets = torch.zeros((), dtype=torch.long, device="cuda"), []
    step = GraphedStep(lambda: runs.add_(1), enabled=True, device=runs.device, reset=lambda: resets.append(1),
                       warmup=2)
    torch.cuda.synchronize()
    assert step.captured and int(runs) == 2 + warm and len(resets) == 3 + warm
    step()
    assert int(runs) == 3 + warm and len(resets) == 3 + warm


TRITON_SCRIPT = textwrap.dedent("""
    import json, torch
    from dflash_lab.spec_decode.fast import triton_ops
    from dflash_lab.layers import RMSNorm, apply_rope, rope_cos_sin
    torch.manual_seed(0)
    errs = []
    for D in (64, 256):
        m = RMSNorm(D, 1e-6); m.weight.data.normal_(1, .3)
        x = torch.randn(7, 3, 2 * D)[..., :D] * 3  # strided rows
        errs.append((triton_ops.norm(m, x) - m(x)).abs().max().item())
    for hd, rd in ((64, 64), (64, 32)):
        m = RMSNorm(hd, 1e-6); m.weight.data.normal_(1, .3)
        proj = torch.randn(2, 5, 4 * hd + 40) * 2
        x = proj[..., 8:8 + 4 * hd]
        cos, sin = rope_cos_sin(torch.randint(0, 3000, (2, 5)), rd, 10000.0, torch.float32)
        ref = apply_rope(m(x.unflatten(-1, (4, hd))), cos, sin)
        errs.append((triton_ops.norm_rope(m, x, cos, sin, 4, hd) - ref).abs().max().item())
    for G, D in ((5, 64), (3, 48)):  # a drafter's aux layers: each slice its own norm, in one kernel
        mods = torch.nn.ModuleList(RMSNorm(D, 1e-6) for _ in range(G))
        for m in mods:
            m.weight.data.normal_(1, .3)
        aux = torch.randn(9, G * D) * 2
        stacked = {}
        with torch.no_grad():
            errs.append((triton_ops.norms(mods, aux, stacked) - torch.cat([m(s) for m, s in zip(mods, aux.split(D, -1))],
                                                                          -1)).abs().max().item())
            assert len(stacked) == 1  # the kernel ran on the stacked weights
            mods[1].weight.mul_(2)
            stacked.clear()  # the drafter's refresh_context_kv_buffers
            errs.append((triton_ops.norms(mods, aux, stacked)[:, D:2 * D] - mods[1](aux[:, D:2 * D])).abs().max().item())
    try:
        triton_ops.rms_norm(torch.randn(2, 50), torch.ones(3, 16), 1e-6)
        refused = ""
    except ValueError as e:
        refused = str(e)
    print(json.dumps({"enabled": triton_ops.enabled(x), "errs": errs, "refused": refused}))
""")


def test_fused_norm_kernels_match_the_modules_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["enabled"] and max(out["errs"]) < 1e-5, out
    assert "50 is not 3 x the weight's 16" in out["refused"]


# ---------------------------------------------------------------------------
# GPU (pytest -m gpu -s tests/test_fast_decode.py)
# ---------------------------------------------------------------------------


def _gpu_pair(dtype):
    from dflash_lab.assets import heldout_prompts, load_default_pair

    target, drafter, tok = load_default_pair("cuda", dtype=dtype)
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-96:], device="cuda") for p in heldout_prompts()[:6]]
    return target, drafter, prompts


RUNS = [("dflash", 4), ("dflash", 8), ("dflash", 16), ("ngram", 8), ("ngram_gpu", 8), (None, 1)]


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_greedy_equals_generate_in_float32():
    target, drafter, prompts = _gpu_pair(torch.float32)
    n_new, report = 48, {}
    expected = [target.generate(p[None], max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
                for p in prompts]
    for proposer, block in RUNS:
        prop = drafter if proposer == "dflash" else proposer
        one = [fast_generate(target, prop, p, max_new_tokens=n_new, block_size=block) for p in prompts]
        batch = fast_generate_batch(target, prop, prompts, max_new_tokens=n_new, block_size=block)
        plain = fast_generate_batch(target, prop, prompts, max_new_tokens=n_new, block_size=block, cuda_graphs=False)
        name = f"{proposer or 'target_only'} b{block}"
        report[name] = {
            "one_by_one_equal_generate": sum(torch.equal(r.output_ids[0], e) for r, e in zip(one, expected)),
            "batch_equal_generate": sum(torch.equal(r.output_ids[0], e) for r, e in zip(batch, expected)),
            "graphed_equal_ungraphed": sum(a.new_token_ids == b.new_token_ids for a, b in zip(batch, plain)),
            "tau": round(sum(r.stats.num_accepted_tokens for r in one) / max(sum(r.stats.num_drafts for r in one), 1) + 1, 3),
        }
    print("\nGPU float32, graphed fast path vs target.generate (of", len(prompts), "prompts):", json.dumps(report))
    for name, r in report.items():
        assert r["one_by_one_equal_generate"] == r["batch_equal_generate"] == r["graphed_equal_ungraphed"] == len(prompts), name


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_graphed_equals_ungraphed_and_reports_agreement_with_the_eager_loop():
    target, drafter, prompts = _gpu_pair(torch.bfloat16)
    n_new, report = 48, {}
    for block in (8, 16):
        graphed = fast_generate_batch(target, drafter, prompts, max_new_tokens=n_new, block_size=block)
        plain = fast_generate_batch(target, drafter, prompts, max_new_tokens=n_new, block_size=block, cuda_graphs=False)
        eager = [speculative_generate(target, drafter, p[None], max_new_tokens=n_new, block_size=block) for p in prompts]
        report[block] = {"graphed_equal_ungraphed": sum(a.new_token_ids == b.new_token_ids for a, b in zip(graphed, plain)),
                         "equal_eager_loop": sum(a.new_token_ids == e.new_token_ids for a, e in zip(graphed, eager))}
        assert report[block]["graphed_equal_ungraphed"] == len(prompts)  # the same kernels, replayed
    print("\nGPU bf16 (near-ties may flip against the eager loop):", json.dumps(report))


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_step_never_waits_for_the_host():
    target, drafter, prompts = _gpu_pair(torch.bfloat16)
    dec = FastDecoder(target, drafter, batch=2, block_size=16, capacity=200, cuda_graphs=False)
    dec.prefill(prompts[:2], 64, ())
    dec.step()  # Triton compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------
# Serving a stream: continuous batching (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["dflash", "ngram", "ngram_gpu", None])
def test_continuous_batching_serves_every_request_as_if_it_ran_alone(small_pair, proposer):
    """Ten ragged requests through 3 rows: a finished row is refilled while the others go on. Every request's
    tokens are target.generate's and its counts the eager loop's; the static policy gives the same requests
    in more batch steps (the straggler effect), and both count what they ran."""
    from dflash_lab.spec_decode.fast.serving import serve

    target, drafter = small_pair
    drafter = drafter if proposer == "dflash" else proposer
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 500, (int(n),), generator=g) for n in torch.randint(3, 80, (10,), generator=g)]
    max_new = [int(n) for n in torch.randint(2, 21, (10,), generator=g)]  # each request its own max_tokens
    dec = FastDecoder(target, drafter, batch=3, block_size=8 if drafter is not None else 1, capacity=80 + 20,
                      cuda_graphs=False)
    runs = {policy: serve(dec, prompts, max_new_tokens=max_new, stop_token_ids=[7], policy=policy)
            for policy in ("continuous", "static")}
    runs["continuous, refill at 2"] = serve(dec, prompts, max_new_tokens=max_new, stop_token_ids=[7], refill_at=2)
    for policy, run in runs.items():
        assert [r.index for r in run.requests] == list(range(10)) and len({r.row for r in run.requests}) == 3
        for p, n, req in zip(prompts, max_new, run.requests):
            eager = speculative_generate(target, drafter, p[None], max_new_tokens=n, stop_token_ids=[7],
                                         block_size=8 if drafter is not None else None)
            assert torch.equal(req.result.output_ids, eager.output_ids), policy
            if drafter is not None:
                assert counters(req.result.stats) == counters(eager.stats), policy
            assert 0 <= req.admitted_s <= req.first_token_s <= req.finished_s <= run.seconds
        m = run.metrics()
        assert m["tokens"] == sum(r.num_tokens for r in run.requests) == run.stats.num_generated_tokens
        assert m["mean_e2el_ms"] >= m["mean_ttft_ms"] > 0
        if proposer != "ngram":  # drafted on the device: the state is read once per burst and once after the
            assert run.reads == run.bursts + 1  # first prefill, never after a refill (the host knows the new rows)
    cont, static, paired = runs["continuous"], runs["static"], runs["continuous, refill at 2"]
    assert cont.fills > static.fills == 4  # ceil(10 / 3) batches; continuous refills rows as they free
    assert paired.fills <= cont.fills  # rows refilled two at a time share a prefill
    assert cont.steps < static.steps  # no row waits for its batch's slowest sequence
    # a request admitted later waited for a row: the fourth request starts only after one of the first three ends
    assert min(r.finished_s for r in cont.requests[:3]) <= cont.requests[3].admitted_s


def test_serve_refuses_what_it_cannot_run(small_pair):
    from dflash_lab.spec_decode.fast.serving import serve

    target, drafter = small_pair
    dec = FastDecoder(target, drafter, batch=2, block_size=4, capacity=64, cuda_graphs=False)
    with pytest.raises(ValueError, match="policy"):
        serve(dec, [torch.tensor(PROMPTS[0])], max_new_tokens=4, policy="round-robin")
    with pytest.raises(ValueError, match="max_new_tokens"):
        serve(dec, [torch.tensor(PROMPTS[0])], max_new_tokens=0)
    with pytest.raises(ValueError, match="one per prompt"):
        serve(dec, [torch.tensor(PROMPTS[0])] * 2, max_new_tokens=[4])
    with pytest.raises(ValueError, match="capacity"):
        serve(dec, [torch.tensor(PROMPTS[0])], max_new_tokens=200)


@pytest.mark.parametrize("proposer", ["dflash", "ngram", "ngram_gpu"])
def test_a_per_batch_schedule_drafts_the_k_vllm_reads_for_the_running_batch(small_pair, proposer):
    """vLLM 0.33's num_speculative_tokens_per_batch_size on the fast path: K by the number of running
    requests (here 3 running: K 1, fewer: K 7); outputs stay target.generate's, every draft is at most
    that K, and the steps ran at both widths (the stream drains below 3 at its end)."""
    from dflash_lab.spec_decode.fast.serving import serve
    from dflash_lab.spec_decode.schedule import SpeculationSchedule

    target, drafter = small_pair
    drafter = drafter if proposer == "dflash" else proposer
    k_full = 0 if proposer == "ngram" else 1  # host prompt lookup: no drafts at all while 3 run (device steps)
    schedule = SpeculationSchedule.from_config([[1, 2, 7], [3, 3, k_full]], max_batch=3, num_speculative_tokens=7)
    prompts = [torch.tensor(p * 3) for p in PROMPTS] * 2
    dec = FastDecoder(target, drafter, batch=3, block_size=8, capacity=64, cuda_graphs=False,
                      widths=[k + 1 for k in schedule.ks])
    max_new = [16, 8, 4, 12, 16, 6]  # ragged ends: the stream's last requests run fewer than 3 at a time
    run = serve(dec, prompts, max_new_tokens=max_new, schedule=schedule)
    for p, n, req in zip(prompts, max_new, run.requests):
        expected = target.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(req.result.output_ids, expected)
    assert set(run.widths) == {k_full + 1, 8} and sum(run.widths.values()) == run.steps
    assert run.stats.num_draft_tokens <= 7 * run.stats.num_drafts
    with pytest.raises(ValueError, match="widths"):  # a width the decoder did not capture is refused up front
        serve(FastDecoder(target, drafter, batch=3, block_size=8, capacity=64, cuda_graphs=False), prompts,
              max_new_tokens=4, schedule=SpeculationSchedule.from_config([[1, 3, 3]], 3, 7))



def test_a_k0_step_skips_the_drafters_query_pass_and_keeps_its_context_kv_as_vllm_does(small_pair):
    """A DFlash step the schedule gives K = 0 is vLLM 0.33's (v1/worker/gpu/spec_decode/dflash/speculator.py
    546-553: "store the context K/V to keep the drafter in sync, and skip the query pass"): no draft forward,
    the verified token's context K/V appended all the same, so the next K > 0 step drafts from a full context
    (outputs stay target.generate's)."""
    from dflash_lab.spec_decode.fast.serving import serve
    from dflash_lab.spec_decode.schedule import SpeculationSchedule

    target, drafter = small_pair
    schedule = SpeculationSchedule.from_config([[1, 1, 7], [2, 3, 0]], max_batch=3, num_speculative_tokens=7)
    dec = FastDecoder(target, drafter, batch=3, block_size=8, capacity=64, cuda_graphs=False,
                      widths=[k + 1 for k in schedule.ks])
    calls = {"draft": 0, "append_width_1": 0, "append": 0}
    draft, append = dec.dft.draft, dec.dft.append

    def counted_draft(*a, **kw):
        calls["draft"] += 1
        return draft(*a, **kw)

    def counted_append(aux, positions, *a, **kw):
        calls["append"] += 1
        calls["append_width_1"] += positions.shape[-1] == 1
        return append(aux, positions, *a, **kw)

    dec.dft.draft, dec.dft.append = counted_draft, counted_append
    prompts = [torch.tensor(p * 3) for p in PROMPTS]
    max_new = [16, 6, 10]  # two finish early: the last one runs alone, at K = 7
    run = serve(dec, prompts, max_new_tokens=max_new, schedule=schedule)
    for p, n, req in zip(prompts, max_new, run.requests):
        expected = target.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(req.result.output_ids, expected)
    assert run.widths.get(1, 0) > 0 and run.widths.get(8, 0) > 0, run.widths
    assert calls["append_width_1"] == run.widths[1]  # every K = 0 step kept the drafter's context in sync
    assert calls["draft"] == run.widths[8]  # and only the K = 7 steps ran the drafter's query pass



def test_a_k0_step_of_prompt_lookup_on_the_device_launches_target_onlys_kernels(small_pair):
    """Where a schedule turns the device prompt lookup off (K = 0) its step is target-only's, kernel for kernel
    (counted by op on the CPU): a server loses nothing to a method it stopped running."""
    from dflash_lab.measure.launches import count_launches

    target, _ = small_pair
    prompts = [torch.tensor(p * 3) for p in PROMPTS]
    seen = {}
    for name, proposer, block in (("target_only", None, 1), ("ngram_gpu", "ngram_gpu", 8)):
        dec = FastDecoder(target, proposer, batch=3, block_size=block, capacity=64, cuda_graphs=False,
                          widths=[1] if block > 1 else ())
        with torch.no_grad():
            dec.prefill(prompts, 8)
            dec.step_at(1)()  # one-off work outside the count
            with count_launches() as seen[name]:
                dec.step_at(1)()
    assert seen["ngram_gpu"].total > 0 and seen["ngram_gpu"].by_name == seen["target_only"].by_name


def test_a_narrower_step_drafts_the_whole_block_and_keeps_its_first_k_as_vllm_does(shipped):
    """At 0 < K < block - 1 vLLM 0.33's DFlash speculator still runs its 1 + num_speculative_tokens queries
    (dflash/speculator.py:565-574) and drops the drafts past K (model_runner.py:2324-2325). The shipped drafter
    is not causal inside the block, so a shorter block would draft other tokens: the decoder's K drafts are the
    whole block's first K, which for some rows differ from a (K+1)-long block's."""
    target, drafter, prompts = shipped
    dec = FastDecoder(target, drafter, batch=4, block_size=16, capacity=160, cuda_graphs=False, widths=[4])
    assert not drafter.config.is_causal
    dec.prefill(prompts, 32, ())
    differ = 0
    for _ in range(6):
        dec._draft(4)
        whole = dec.dft.draft(dec.last, dec.pos, 16)[:, :3]
        assert torch.equal(dec.drafts[:, :3], whole)
        differ += int((dec.dft.draft(dec.last, dec.pos, 4) != whole).any(-1).sum())
        dec._verify(4)
        dec._append(4)
        dec._accept(4)
    assert differ > 0  # the block's length matters to this drafter, so which block is drafted is observable

def test_serving_records_are_the_timing_records_with_vllm_bench_serves_latencies(small_pair):
    """measure_serving: one record per (method, block, concurrency, batching), outputs equal target-only's,
    static batches run as long as their slowest request, speed-ups taken at the same concurrency and batching."""
    from dflash_lab.measure.serving import measure_serving, serving_speedups

    target, drafter = small_pair
    prompts = [torch.tensor(p) for p in PROMPTS]
    records = measure_serving(target, {"dflash": drafter}, prompts, concurrencies=(1, 2), block_sizes=(4,),
                              num_requests=5, max_new_tokens=6, cuda_graphs=False, progress=lambda s: None)
    runs = {(r["batch"], r["batching"], r["method"]) for r in records}
    assert runs == {(c, b, m) for m in ("target_only", "dflash", "prompt_lookup", "prompt_lookup_gpu") for c, b in
                    ((1, "continuous"), (2, "continuous"), (2, "static"))}
    for r in records:
        assert r["outputs_equal_target_only"] == "5/5" and r["requests"] == 5 and len(r["request_steps"]) == 5
        assert r["tokens"] == 30 and r["p99_e2el_ms"] >= r["median_e2el_ms"] > 0
        assert 1 <= r["bursts"] <= r["batch_steps"] and r["fills"] >= 1  # every burst launched at least a step
        if r["batching"] == "static":
            assert r["static_batch_steps"] == [max(r["request_steps"][i:i + 2]) for i in (0, 2, 4)]
            assert r["batch_steps"] == sum(r["static_batch_steps"])
    assert {(s["batch"], s["batching"]) for s in serving_speedups(records) if s["method"] == "target_only"
            and s["speedup"] == 1.0} == {(1, "continuous"), (2, "continuous"), (2, "static")}
    from dflash_lab.tools.bench_serving import serving_markdown

    md = serving_markdown({"device": "cpu", "command": "c", "requests": 5, "max_new_tokens": 6,
                           "prompt_sets": ["heldout"], "records": records, "phases": {}})
    rows = [line for line in md.splitlines() if line.startswith("| 2 | static |")]
    assert len(rows) == 4 and "| 1.00x |" in next(r for r in rows if "target_only" in r)
    from dflash_lab.measure.serving import time_split

    # the time split: batch steps at the phase-timed step, the rest outside; static runs and untimed blocks left out
    step_ms = {"target_only": 2.0, "dflash": 5.0}
    phases = {str(c): {m: {"block_size": 1 if m == "target_only" else 4, "whole_step_ms": ms}
                       for m, ms in step_ms.items()} for c in (1, 2)}
    split = time_split({"records": records, "phases": phases})
    assert {(r["method"], r["batch"]) for r in split} == {(m, c) for m in step_ms for c in (1, 2)}
    for row in split:
        rec = next(r for r in records if r["method"] == row["method"] and r["batch"] == row["batch"]
                   and r["batching"] == "continuous")
        assert row["in_steps_s"] == pytest.approx(rec["batch_steps"] * step_ms[row["method"]] / 1e3, abs=1e-4)
        assert row["in_steps_s"] + row["outside_s"] == pytest.approx(rec["seconds"], abs=2e-4)
        assert row["occupancy"] == pytest.approx(sum(rec["request_steps"]) / (row["batch"] * rec["batch_steps"]),
                                                 abs=1e-3)
        assert 0 < row["occupancy"] <= 1


@pytest.mark.gpu
@needs_cuda
def test_gpu_served_streams_read_one_step_behind_and_stay_exact():
    """On CUDA ``serve(read_behind=True)`` reads the rows' state one step behind (the copy runs beside the
    next step): every request served continuously, in ragged lengths, is still target.generate's, float32."""
    from dflash_lab.spec_decode.fast.serving import serve

    target, drafter, prompts = _gpu_pair(torch.float32)
    stream = prompts * 3  # 18 requests at concurrency 4
    limits = [16 + 7 * (i % 5) for i in range(len(stream))]
    expected = [target.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, p.shape[0]:].tolist() for p, n in zip(stream, limits)]
    for proposer, block in ((drafter, 16), (None, 1)):
        dec = FastDecoder(target, proposer, batch=4, block_size=block, capacity=200)
        for behind in (True, False):
            run = serve(dec, stream, max_new_tokens=limits, refill_at=2, read_behind=behind)
            assert [r.result.new_token_ids for r in run.requests] == expected, (block, behind)
