"""Refills carried by the steps (spec_decode.fast.chunked_fill): a freed row's prompt is verified a chunk at a time
inside the graphed step, as vLLM's scheduler mixes a new request's prompt tokens into the decode batch.

CPU: every request of a served stream is the eager loop's, token for token and counter for counter, with its
prompt carried by the steps (DFlash, the device prompt lookup, target-only) and under a per-batch schedule whose
width changes the chunk; only the first batch runs a prefill forward; what cannot carry a prompt is refused;
the serving records label chunked runs. GPU (marked ``gpu``): the graphed stream equals ``target.generate``.
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.spec_decode import speculative_generate
from dflash_lab.spec_decode.fast.decoder import FastDecoder
from dflash_lab.spec_decode.fast.serving import serve
from test_fast_decode import counters, needs_cuda, small_drafter, small_target


@pytest.fixture(scope="module")
def small_pair():
    target = small_target()
    return target, small_drafter(target)


def ragged_stream(n=10, seed=11):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 500, (int(t),), generator=g) for t in torch.randint(3, 80, (n,), generator=g)]
    return prompts, [int(m) for m in torch.randint(2, 21, (n,), generator=g)]


@pytest.mark.parametrize("proposer", ["dflash", "ngram_gpu", None])
def test_a_prompt_carried_by_the_steps_gives_each_request_what_it_gives_alone(small_pair, proposer):
    """Ten ragged requests (prompts of 3-79 tokens, a stop token) through 3 rows of block 8: every refill's prompt
    rides in the next steps. Tokens and draft counters are the eager loop's; the first batch is the only
    prefill forward; a refilled request's first token comes out after it was admitted."""
    target, drafter = small_pair
    drafter = drafter if proposer == "dflash" else proposer
    block = 8 if drafter is not None else 1
    prompts, max_new = ragged_stream()
    dec = FastDecoder(target, drafter, batch=3, block_size=block, capacity=100, cuda_graphs=False, chunked_fill=True)
    run = serve(dec, prompts, max_new_tokens=max_new, stop_token_ids=[7], refill="chunked")
    for p, n, req in zip(prompts, max_new, run.requests):
        eager = speculative_generate(target, drafter, p[None], max_new_tokens=n, stop_token_ids=[7],
                                     block_size=block if drafter is not None else None)
        assert torch.equal(req.result.output_ids, eager.output_ids), req.index
        if drafter is not None:
            assert counters(req.result.stats) == counters(eager.stats), req.index
        assert 0 <= req.admitted_s <= req.first_token_s <= req.finished_s <= run.seconds
    assert len(dec.prefills) == 1 and run.fills > 1  # one prefill graph: the first batch's
    assert run.refill == run.metrics()["refill"] == "chunked"
    late = [r for r in run.requests if r.index >= 3]
    assert all(r.first_token_s > r.admitted_s for r in late)
    # the same stream with each refill its own forward runs fewer steps: the chunks ride in the steps
    plain = serve(FastDecoder(target, drafter, batch=3, block_size=block, capacity=100, cuda_graphs=False), prompts,
                  max_new_tokens=max_new, stop_token_ids=[7])
    assert [r.result.new_token_ids for r in plain.requests] == [r.result.new_token_ids for r in run.requests]
    assert run.steps > plain.steps


def test_a_schedules_width_is_the_chunk_and_the_prompt_still_arrives_whole(small_pair):
    """Under vLLM's per-batch schedule (3 running: K 1, fewer: K 7) a prompt is carried 2 or 8 tokens a step,
    as the running batch gives; outputs stay target.generate's and both widths ran."""
    from dflash_lab.spec_decode.schedule import SpeculationSchedule

    target, drafter = small_pair
    schedule = SpeculationSchedule.from_config([[1, 2, 7], [3, 3, 1]], max_batch=3, num_speculative_tokens=7)
    prompts, max_new = ragged_stream(seed=5)
    dec = FastDecoder(target, drafter, batch=3, block_size=8, capacity=100, cuda_graphs=False,
                      widths=[k + 1 for k in schedule.ks], chunked_fill=True)
    run = serve(dec, prompts, max_new_tokens=max_new, schedule=schedule, refill="chunked")
    for p, n, req in zip(prompts, max_new, run.requests):
        expected = target.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(req.result.output_ids, expected), req.index
    assert set(run.widths) == {2, 8}


def test_what_cannot_carry_a_prompt_is_refused(small_pair):
    target, drafter = small_pair
    with pytest.raises(ValueError, match="chunked_fill"):  # host prompt lookup reads every step back
        FastDecoder(target, "ngram", batch=2, block_size=4, capacity=64, cuda_graphs=False, chunked_fill=True)
    with pytest.raises(ValueError, match="chunked_fill"):
        FastDecoder(target, drafter, batch=2, block_size=4, capacity=64, cuda_graphs=False, chunked_fill=True,
                    tree_budget=4)
    plain = FastDecoder(target, drafter, batch=2, block_size=4, capacity=64, cuda_graphs=False)
    prompt = torch.arange(10, 20)
    with pytest.raises(ValueError, match="chunked_fill=True"):
        serve(plain, [prompt], max_new_tokens=4, refill="chunked")
    with pytest.raises(ValueError, match="chunked_fill=True"):
        plain.fill({0: prompt}, 4, chunked=True)
    with pytest.raises(ValueError, match="refill must be one of"):
        serve(plain, [prompt], max_new_tokens=4, refill="lazy")


def test_serving_records_label_chunked_runs_and_draw_them(small_pair):
    """measure_serving(refills=both): each drafter on the device also runs chunked (continuous only), its own
    row in the tables ("<method> (chunked)") and a long-dashed trace; host prompt lookup and target-only are not
    chunked; every output is target-only's."""
    from dflash_lab.measure.serving import best_blocks, measure_serving, run_label
    from dflash_lab.tools.bench_serving import serving_markdown
    from dflash_lab.viz.serving import serving_speedup_figure

    target, drafter = small_pair
    prompts, _ = ragged_stream(n=4)
    records = measure_serving(target, {"dflash": drafter}, prompts, concurrencies=(2,), block_sizes=(4,),
                              num_requests=5, max_new_tokens=6, cuda_graphs=False, refills=("prefill", "chunked"),
                              progress=lambda s: None)
    chunked = {(r["method"], r["batching"]) for r in records if r["refill"] == "chunked"}
    assert chunked == {("dflash", "continuous"), ("prompt_lookup_gpu", "continuous")}
    assert all(r["outputs_equal_target_only"] == "5/5" for r in records)
    best = best_blocks(records)
    assert {m for _, m, _ in best} == {"target_only", "dflash", "prompt_lookup", "prompt_lookup_gpu",
                                       "dflash (chunked)", "prompt_lookup_gpu (chunked)"}
    assert run_label({"method": "dflash", "schedule": [[1, 2, 3]], "refill": "chunked"}) == "dflash (scheduled, chunked)"
    md = serving_markdown({"device": "cpu", "command": "c", "requests": 5, "max_new_tokens": 6,
                           "prompt_sets": ["heldout"], "records": records, "phases": {}})
    row = best["heldout", "dflash (chunked)", 2]
    assert f"| 2 | continuous | dflash (chunked) | 4 | {row['tokens_per_s']:.0f} |" in md
    fig = serving_speedup_figure(records, methods=("dflash",))
    trace = next(t for t in fig.data if t.name == "dflash, chunked")
    base = best["heldout", "target_only", 2]["tokens_per_s"]
    assert trace.line.dash == "longdash" and list(trace.y) == [row["tokens_per_s"] / base]


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_chunked_refills_equal_generate_in_float32():
    """The shipped pair in float32, graphed: 12 requests through 4 rows with every refill carried by the steps,
    for both shipped drafters and the device prompt lookup: each request's tokens are the same kernels' launched
    eagerly (graphs off), and target.generate's, as a stream whose refills are their own prefill gives them."""
    import json

    from dflash_lab.assets import heldout_prompts, load_default_pair

    target, paper, tok = load_default_pair("cuda", dtype=torch.float32)
    poolside = load_default_pair("cuda", dtype=torch.float32, drafter="poolside")[1]
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:], device="cuda")
               for p, n in zip(heldout_prompts()[:12], (96, 40, 57, 23) * 3)]
    expected = [target.generate(p[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
                for p in prompts]
    report = {}
    for name, drafter in (("paper", paper), ("poolside", poolside), ("ngram_gpu", "ngram_gpu")):
        runs = {}
        for how, graphs, refill in (("graphed", True, "chunked"), ("eager", False, "chunked"),
                                    ("prefill refills", True, "prefill")):
            dec = FastDecoder(target, drafter, batch=4, block_size=16, capacity=160, cuda_graphs=graphs,
                              chunked_fill=refill == "chunked")
            serve(dec, prompts, max_new_tokens=2, refill=refill)  # the first batch's prefill graph, captured
            runs[how] = [r.result.output_ids[0] for r in serve(dec, prompts, max_new_tokens=32, refill=refill).requests]
        report[name] = {how: sum(torch.equal(a, e) for a, e in zip(out, expected)) for how, out in runs.items()}
        report[name]["graphed_equal_eager"] = sum(torch.equal(a, b) for a, b in zip(runs["graphed"], runs["eager"]))
    print("\nGPU float32, chunked refills (requests equal to target.generate, of 12):", json.dumps(report))
    for name, r in report.items():
        assert r["graphed_equal_eager"] == len(prompts), name  # the same kernels, replayed
        assert r["graphed"] == r["prefill refills"] == len(prompts), name


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_refills_upload_is_queued_behind_the_running_steps():
    """runtime.upload: a host tensor sent while the device is still busy returns at once (the stream still has
    work queued when it does; a pageable copy would have waited for all of it) and lands after that work."""
    from dflash_lab.runtime import upload

    a = torch.randn(4096, 4096, device="cuda")
    dst = torch.zeros(64, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    for _ in range(40):  # tens of milliseconds of queued work
        a = a @ a / 64
    upload(dst, torch.arange(64))
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the upload waited for the queued work"
    assert torch.equal(dst.cpu(), torch.arange(64))
    with_pageable = torch.zeros_like(dst)
    for _ in range(40):
        a = a @ a / 64
    with_pageable.copy_(torch.arange(64))  # the copy this replaces: the host waits for the queue
    assert torch.cuda.current_stream().query()
