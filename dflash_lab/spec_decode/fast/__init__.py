"""The fast backend of DFlash decoding: the same algorithm over static buffers, the way a server runs it.

    attention          one kernel a layer for attention over the static buffers: which slots a query sees
                       computed from positions (causal, window, a tree's ancestors, a drafter block), the gate
    triton_ops         one-kernel RMSNorm and q/k head norm + RoPE, for the forwards below (and the
                       attention kernel handed to the drafter as ``ops``)
    static_target      the target's forward over a preallocated KV cache, no host syncs
    static_drafter     the drafter's context K/V in slots (slot == position), and its block step
                       through the drafter's own attention (``block_attention.SlotKV``; the kernel
                       above where it runs)
    cuda_graphs        capture a step once, replay it with one launch
    decoder            ``FastDecoder``: several prompts, ragged acceptance, the accept rule of
                       ``spec_decode.sampling``; a row refilled while the others go on
    tree_step          its DDTree step: a tree of the block's best prefixes, verified in one graph
    generate           ``fast_generate`` / ``fast_generate_batch``: one call, a cached decoder
    readback           finished rows' tokens and counters copied back without waiting, results built after
    serving            ``serve``: a stream of requests at a concurrency, continuous batching as
                       vLLM's scheduler does it, with the per-request latencies ``vllm bench serve`` reports
    chunked_fill       a refilled row's prompt verified a chunk at a time inside the step (no prefill
                       forward of its own), as vLLM mixes a new request's prompt into the decode batch
    host_drafting      prompt lookup drafted on the host: drafts from each row's tokens, read back every step

Nothing is imported here: ``triton_ops`` serves the static forwards without the decoder that drives
them. (The fused epilogue of the folded context-K/V path is no part of this backend: it sits beside
``context_kv.py``, below the drafter, as ``dflash_lab.context_kv_kernel``.)
"""
