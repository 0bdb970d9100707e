"""Prompt lookup as vLLM 0.33 drafts it on a GPU (``spec_decode.ngram_gpu``): the V2 runner's NgramGPUSpeculator.

vLLM's own two Triton kernels (``v1/worker/gpu/spec_decode/ngram/speculator.py``) run here in Triton's CPU
interpreter, jitted by Triton from vLLM's installed source, on random sequences; the lab's tensor ops must
draft exactly what they draft. The fast path's use of it (drafted inside the step, no read-back) is checked in
``test_fast_decode`` beside the other proposers.
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.spec_decode.ngram_gpu import ngram_gpu_drafts
from dflash_lab.spec_decode.proposers import PromptLookupGPUDrafter, prompt_lookup, resolve_drafter

VLLM_KERNELS = r"""
import json, torch, triton, triton.language as tl
import vllm.v1.worker.gpu.spec_decode.ngram.speculator as spec
# vLLM reads Triton through its own shim, which stands in placeholders where no GPU is found: jit its kernels'
# source with Triton itself (the interpreter runs them on the CPU)
kernels = {}
for name in ("_ngram_scan_kernel", "_ngram_finalize_kernel"):
    fn = getattr(spec, name)
    fn = getattr(fn, "fn", fn)
    fn.__globals__["tl"] = tl
    kernels[name] = triton.jit(fn)
from dflash_lab.spec_decode.ngram_gpu import ngram_gpu_drafts
out = []
g = torch.Generator().manual_seed(5)
for L, vocab, min_n, max_n, K in [(96, 3, 2, 5, 7), (96, 6, 1, 3, 15), (300, 4, 3, 3, 4), (64, 2, 2, 4, 9)]:
    block_l = 128 if L >= 256 else 64  # the speculator's choice for max_model_len L
    nb = triton.cdiv(L, block_l)
    B = 8
    lens = torch.randint(1, L, (B,), generator=g, dtype=torch.int32)
    lens[0], lens[1] = 1, min_n  # too short to match
    tok = torch.randint(0, vocab, (B, L), generator=g, dtype=torch.int32)
    tok[2, :] = torch.arange(L) % 100 + 10  # a row without any repeat: no match
    idx = torch.arange(B, dtype=torch.int64)
    last = tok[idx, lens.long() - 1].long()
    scratch = torch.zeros(B, nb, dtype=torch.int64)
    drafts = torch.zeros(B, K, dtype=torch.int64)
    kernels["_ngram_scan_kernel"][(B, nb)](tok, tok.stride(0), idx, lens, torch.ones(B, dtype=torch.int32), scratch,
                                           scratch.stride(0), L, min_n, max_n, triton.next_power_of_2(max_n), block_l)
    kernels["_ngram_finalize_kernel"][(B,)](tok, tok.stride(0), idx, lens, torch.ones(B, dtype=torch.int32), last,
                                            scratch, scratch.stride(0), drafts, L, nb, K, triton.next_power_of_2(K),
                                            triton.next_power_of_2(nb))
    ours = ngram_gpu_drafts(tok.long(), lens.long(), last, min_n=min_n, max_n=max_n, k=K)
    out.append({"vllm": drafts.tolist(), "lab": ours.tolist(), "last": last.tolist()})
print(json.dumps(out))
"""


def test_the_lab_drafts_what_vllms_own_ngram_gpu_kernels_draft(interpreted):
    cases = interpreted(VLLM_KERNELS)
    assert len(cases) == 4
    for case in cases:
        assert case["lab"] == case["vllm"]
        # the rows that cannot match (too short, no repeat) got the last token K times; others found drafts
        for row in (0, 1, 2):
            assert set(case["vllm"][row]) == {case["last"][row]}
        assert any(set(d) != {t} for d, t in zip(case["vllm"][3:], case["last"][3:]))


def test_the_longest_ngram_wins_then_its_rightmost_match_and_k_drafts_always():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    seq = [1, 2, 3, 7, 1, 2, 3, 8, 9, 1, 2, 3]  # ends in "1 2 3": it occurs at 0 and at 4
    t = torch.tensor([seq + [0, 0, 0]])  # past the length: never read
    length, last = torch.tensor([len(seq)]), torch.tensor([seq[-1]])
    d = ngram_gpu_drafts(t, length, last, min_n=2, max_n=5, k=6)[0].tolist()
    assert d == [8, 9, 1, 2, 3, 3]  # after the rightmost "1 2 3" (at 4): 8 9 1 2 3, then the last token again
    assert PromptLookupGPUDrafter().propose(seq, 6) == d
    assert prompt_lookup(seq, 6) == [7, 1, 2, 3, 8, 9]  # the V1 runner's rule: the earliest match, as found
    # a longer n-gram beats a later shorter one: "5 1 2 3" occurs once, "2 3" later as well
    seq2 = [5, 1, 2, 3, 4, 2, 3, 6, 5, 1, 2, 3]
    assert PromptLookupGPUDrafter().propose(seq2, 2) == [4, 2]
    assert PromptLookupGPUDrafter().propose([4, 4], 3) == [4, 4, 4]  # n = 1 only: none at the default min 2
    assert PromptLookupGPUDrafter(prompt_lookup_min=1).propose([4, 4], 3) == [4, 4, 4]
    assert PromptLookupGPUDrafter(prompt_lookup_min=1).propose([4, 5, 4], 3) == [5, 4, 4]
    assert resolve_drafter("ngram_gpu").kind == "ngram_gpu" and resolve_drafter("ngram").kind == "ngram"


def test_bad_sizes_are_refused_with_vllms_names():
    t, n = torch.zeros(1, 8, dtype=torch.long), torch.tensor([8])
    with pytest.raises(ValueError, match="prompt_lookup_min must be an integer >= 1"):
        ngram_gpu_drafts(t, n, n, min_n=0, max_n=3, k=2)
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=3"):
        ngram_gpu_drafts(t, n, n, min_n=4, max_n=3, k=2)
    with pytest.raises(ValueError, match="k .drafts per row. must be an integer >= 0"):
        ngram_gpu_drafts(t, n, n, min_n=2, max_n=3, k=-1)
    with pytest.raises(ValueError, match=r"tokens must be \(B, S\)"):
        ngram_gpu_drafts(t[0], n, n, min_n=2, max_n=3, k=2)
    with pytest.raises(ValueError, match="drafter must be"):
        resolve_drafter("ngram-gpu")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        PromptLookupGPUDrafter(prompt_lookup_min=0)
