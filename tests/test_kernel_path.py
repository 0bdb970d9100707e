"""The static path with every lab kernel on, end to end, in Triton's CPU interpreter.

One subprocess (``TRITON_INTERPRET=1``, ``DFLASH_LAB_FUSED=1``) serves both questions on the shipped pair:

- lossless: with the kernels (fused attention, router, one-kernel layout, gathered experts with silu on
  load, residual + norm tails, q/k norm + RoPE + cache write, the one-row GEMVs, the DDTree beam search)
  both shipped drafters' fast generation, chain and tree, equals ``target.generate`` token for token in
  float32, and its draft counters equal the eager loop's; so does a served stream whose refill rides in
  the steps (``chunked_fill``);
- cheaper: each phase of a step launches fewer kernels with the kernels than without (``measure.launches``,
  the switch turned off in the same process), and no phase reads a device value on the host (a graphed
  step could not hold one).
"""

from __future__ import annotations

SCRIPT = r"""
import json, os
import torch
from dflash_lab.assets import load_default_pair
from dflash_lab.measure.launches import phase_launches
from dflash_lab.spec_decode.fast.decoder import FastDecoder
from dflash_lab.spec_decode.fast.generate import fast_generate_batch
from dflash_lab.spec_decode.loop import speculative_generate

target, paper, _ = load_default_pair("cpu", dtype=torch.float32)
poolside = load_default_pair("cpu", dtype=torch.float32, drafter="poolside")[1]
prompt = torch.randint(5, 4000, (21,), generator=torch.Generator().manual_seed(0))
new = 12
ref = target.generate(prompt[None], max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
out = {"lossless": {}, "launches": {}}
for name, drafter in (("paper", paper), ("poolside", poolside)):
    fast = fast_generate_batch(target, drafter, [prompt], max_new_tokens=new, block_size=16, cuda_graphs=False)[0]
    eager = speculative_generate(target, drafter, prompt[None], max_new_tokens=new, block_size=16)
    out["lossless"][name] = {
        "equal_generate": torch.equal(fast.output_ids[0], ref),
        "counters": [[fast.stats.num_drafts, fast.stats.num_accepted_tokens],
                     [eager.stats.num_drafts, eager.stats.num_accepted_tokens]]}
    # the DDTree step, its beam search one kernel (``fast.tree_build``): budget 16, a power of two
    tree = FastDecoder(target, drafter, batch=1, block_size=16, capacity=64, cuda_graphs=False,
                       tree_budget=16).generate([prompt], max_new_tokens=new)[0]
    eager_tree = speculative_generate(target, drafter, prompt[None], max_new_tokens=new, block_size=16, tree_budget=16)
    out["lossless"][name + " tree"] = {
        "equal_generate": torch.equal(tree.output_ids[0], ref),
        "counters": [[tree.stats.num_drafts, tree.stats.num_accepted_tokens],
                     [eager_tree.stats.num_drafts, eager_tree.stats.num_accepted_tokens]]}
# refills carried by the steps (``chunked_fill``): three requests through two rows, the third prompt verified a
# chunk at a time inside the steps (the accept kernel, then the chunk's advance)
from dflash_lab.spec_decode.fast.serving import serve
stream = [prompt, prompt[:13], prompt[4:]]
refs = [target.generate(p[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        for p in stream]
for name, drafter in (("paper", paper), ("poolside", poolside)):
    dec = FastDecoder(target, drafter, batch=2, block_size=16, capacity=64, cuda_graphs=False, chunked_fill=True)
    run = serve(dec, stream, max_new_tokens=6, refill="chunked")
    out["lossless"][name + " chunked refill"] = {
        "equal_generate": all(torch.equal(r.result.output_ids[0], e) for r, e in zip(run.requests, refs)),
        "counters": [[sum(r.result.stats.num_drafts for r in run.requests)] * 2, [run.fills, len(dec.prefills)]]}
# the residual tails inside their one-row producers (``residual.IN_PRODUCER``): a target-only step at batch 1 is
# a one-row forward (so is a drafter's step where a schedule gives it K = 0; that runs outside CI: minutes here)
from dflash_lab.measure.launches import count_launches
from dflash_lab.spec_decode.fast import residual
from dflash_lab.spec_decode.fast.serving import serve
residual.IN_PRODUCER = True
with count_launches() as c:
    run = serve(FastDecoder(target, None, batch=1, block_size=16, capacity=64, cuda_graphs=False), [prompt],
                max_new_tokens=3)
residual.IN_PRODUCER = False
out["in_producer"] = {"equal": torch.equal(run.requests[0].result.output_ids[0], ref[:len(prompt) + 3]),
                      "tail_launches": c.by_name.get("triton._residual_norm_kernel", 0), "steps": run.steps,
                      "widths": run.widths, "layers": target.config.num_hidden_layers}
for switch in ("1", "0"):
    os.environ["DFLASH_LAB_FUSED"] = switch
    dec = FastDecoder(target, paper, batch=1, block_size=16, capacity=128, cuda_graphs=False)
    counted = phase_launches(dec, [prompt], max_new_tokens=48)
    out["launches"][switch] = {k: [v.total, sum(v.syncs.values()), sorted(v.triton)] for k, v in counted.items()}
print(json.dumps(out))
"""


def test_kernels_on_are_lossless_and_launch_fewer_kernels_per_phase(interpreted):
    out = interpreted(SCRIPT, "kernel_path.py")
    for name, row in out["lossless"].items():
        assert row["equal_generate"], f"{name}: the kernel path's tokens differ from target.generate"
        if name.endswith("chunked refill"):  # two fills (the first batch, then the third request), one a forward
            assert row["counters"][1] == [2, 1] and row["counters"][0][0] > 0, f"{name}: {row['counters']}"
            continue
        fast, eager = row["counters"]
        assert fast == eager, f"{name}: drafts/accepted {fast} on the kernel path, {eager} in the eager loop"
        assert fast[0] > 0, f"{name}: no draft was verified"
    on, off = out["launches"]["1"], out["launches"]["0"]
    assert not any(kernels for _, _, kernels in off.values()), "the switch off still launched Triton kernels"
    for phase in ("draft", "verify"):
        assert on[phase][2], f"{phase}: no lab kernel ran with the switch on"
        assert on[phase][0] < off[phase][0] / 2, f"{phase}: {on[phase][0]} kernels on, {off[phase][0]} off"
    assert {"_route_kernel", "_align_kernel", "_block_gemm_kernel", "_residual_norm_kernel",
            "_gated_attention_kernel", "_argmax_kernel"} <= set(on["verify"][2])
    from dflash_lab.spec_decode.fast import attention  # RoPE inside the attention kernel only where switched on
    assert ("_qk_rope_write_kernel" in on["verify"][2]) != attention.ROPE_IN, (attention.ROPE_IN, on["verify"][2])
    assert on["accept"][0] == 1 and on["accept"][2] == ["_accept_kernel"], f"accept: {on['accept']}"
    tails = out["in_producer"]  # only the prefill's tails launched: every one-row step ran them in its GEMVs
    assert tails["equal"], "the tails in their producers changed the tokens"
    assert tails["steps"] == 2 and tails["widths"] == {"1": 2}, tails
    assert tails["tail_launches"] == 2 * tails["layers"], tails
    for phase, (_, syncs, _) in on.items():
        assert syncs == 0, f"{phase} reads a device value on the host {syncs} times"
