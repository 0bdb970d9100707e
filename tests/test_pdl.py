"""Programmatic dependent launch (``spec_decode.fast.pdl``): a kernel starts while the previous one drains.

PDL changes when a kernel starts, never what it computes: a decode step graphed with it must give exactly the
logits of the same step graphed without it. A kernel that read an earlier kernel's output before its wait
would read stale data in some replays, and the logits would differ.
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.spec_decode.fast import pdl


def test_no_pdl_off_cuda():
    """The CPU (and Triton's interpreter, which runs on CPU tensors) never gets the launch option."""
    assert pdl.launch(torch.zeros(1)) == {"PDL": False}
    assert not pdl.runs(torch.zeros(1))


def _graphed_decode(model, ids, prompt: int, on: bool) -> torch.Tensor:
    """Prefill ``prompt`` tokens eagerly, then decode the rest one token per replay of a captured graph."""
    from dflash_lab.spec_decode.fast.cuda_graphs import GraphedStep
    from dflash_lab.spec_decode.fast.static_target import StaticTarget

    pdl.ON = on
    try:
        dev = ids.device
        st = StaticTarget(model, batch=1, capacity=ids.shape[1] + 8)
        st.forward(ids[:, :prompt], torch.arange(prompt, device=dev)[None])
        tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        out = {}

        def step():
            out["logits"], _ = st.forward(tok, pos)

        tok.copy_(ids[:, prompt:prompt + 1])
        pos.fill_(prompt)
        graph = GraphedStep(step, enabled=True, device=dev, warmup=2)  # the warm-up steps rewrite the same slot
        logits = []
        for t in range(prompt, ids.shape[1]):
            tok.copy_(ids[:, t:t + 1])
            pos.fill_(t)
            graph()
            logits.append(out["logits"].clone())
        torch.cuda.synchronize()
        return torch.cat(logits, dim=1)
    finally:
        pdl.ON = True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_graphed_decode_is_the_same_with_and_without_pdl():
    """Laguna-XS.2's layer pattern at small widths (wide enough that every GEMV has many programs), bf16: 12
    tokens decoded through a captured graph with PDL on give bit for bit the logits of the same graph
    without it (on a card before Hopper both runs are without it, and the test says only that they agree)."""
    from transformers import LagunaForCausalLM

    from dflash_lab.presets import laguna_xs_2_config

    cfg = laguna_xs_2_config(num_hidden_layers=5, vocab_size=512, hidden_size=512, intermediate_size=1024,
                             head_dim=64, num_attention_heads=8, num_key_value_heads=2, num_experts=32,
                             num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                             sliding_window=16, num_attention_heads_per_layer=[8, 16, 16, 16, 8])
    torch.manual_seed(0)
    model = LagunaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        off = _graphed_decode(model, ids, 28, on=False)
        on = _graphed_decode(model, ids, 28, on=True)
        again = _graphed_decode(model, ids, 28, on=True)
    assert torch.isfinite(off).all()
    assert torch.equal(on, off), (on.float() - off.float()).abs().max().item()
    assert torch.equal(again, off)
