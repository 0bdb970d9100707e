"""THE interop test: vLLM 0.33's own DFlashLagunaForCausalLM loads what save_drafter writes.

On the CPU (VLLM_TARGET_DEVICE=cpu) we construct vLLM's class itself
(vllm/model_executor/models/laguna_dflash.py), with vLLM's config reader on our
config.json, a single-process gloo world, and only the TARGET's model config and
the speculative config as minimal stand-ins. The weights go in through vLLM's
safetensors iterator and vLLM's own load_weights; vLLM's
process_weights_after_loading runs after. Then, in float32:

- every drafter parameter is loaded (vLLM's loader's own completeness rule) and
  equals ours bit for bit; attention layers are named as ours are;
- vLLM's combine_hidden_states matches ours;
- vLLM's context-K/V precompute (precompute_and_store_context_kv: its stacked
  buffers, batched RMSNorm, bmm, K-norm, RoPE and per-layer cache write, the
  write captured) matches all three of our paths;
- vLLM's drafter forward over one block matches ours.

vLLM's post-load step picks a CPU GEMM route per linear layer; the route it
would pick from the processor alone (its AMX kernel for small bf16/fp16
weights) needs an op that only vLLM's CPU build has, so the lab runs that step
with the routes of the installed build (``vllm_post_load``): the same route,
and the same numbers, on a CPU with AMX and on one without (both are tested,
by making torch report AMX or not).

What the CPU cannot run here: vLLM's compiled kernels (torch.ops._C.rms_norm
and rotary_embedding are not in a CUDA wheel on a CPU machine), and its
attention backend. The precompute test with vLLM's real kernels runs only where
they exist and otherwise skips saying so; the other precompute test swaps the two
kernels for vLLM's own native implementations (RotaryEmbedding.forward_static,
and a torch RMSNorm with the kernel's per-layer weight rule). The forward test
supplies attention itself (scaled-dot-product attention over [context K/V ;
block K/V] with the DFlash visibility mask and vLLM's window); everything
around it (qkv split, q/k norms, RoPE, gate, o_proj, MLP, residuals, final
norm) is vLLM's.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("vllm", reason="vLLM is not importable")  # the ONLY reason to skip this file

from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    destroy_distributed_environment,
    destroy_model_parallel,
    model_parallel_is_initialized,
)
from vllm.model_executor.layers import utils as vllm_layer_utils  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator  # noqa: E402
from vllm.model_executor.models import laguna_dflash, qwen3_dflash  # noqa: E402
from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.transformers_utils.config import get_config  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from dflash_lab.checkpoint import save_drafter  # noqa: E402
from dflash_lab.context_kv import CONTEXT_KV_PATHS  # noqa: E402
from dflash_lab.drafter import dflash_attention_mask  # noqa: E402

SHARED_WITH_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}  # vLLM takes these from the target
CASES = [  # (layers, layer type, gating): both layer types, both gate shapes
    pytest.param(2, "full_attention", True, id="full-rotary0.5-gate-per-head"),
    pytest.param(3, "sliding_attention", "per-element", id="sliding-rotary1.0-gate-per-element"),
]


def vllm_kernels_available() -> bool:
    """Whether this vLLM build has its compiled RMSNorm and RoPE ops (a CUDA wheel on a CPU box has not)."""
    return all(hasattr(torch.ops._C, op) for op in ("rms_norm", "rotary_embedding"))


# vLLM's AMX GEMM route on the CPU (model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm) packs
# the weight with the first op and multiplies with the second; only vLLM's CPU build registers them.
VLLM_AMX_GEMM_OPS = ("convert_weight_packed", "weight_packed_linear")


def vllm_has_amx_gemm() -> bool:
    """Whether this vLLM build can run the CPU GEMM route vLLM takes on a processor with AMX tiles."""
    return all(hasattr(torch.ops._C, op) for op in VLLM_AMX_GEMM_OPS)


@contextmanager
def gemm_routes_of_this_build():
    """vLLM's CPU GEMM dispatch, limited to the routes the installed vLLM build has.

    dispatch_cpu_unquantized_gemm asks the processor, not the build, whether to take its AMX
    route (check_cpu_sgl_kernel: AMX tiles, bf16/fp16, weight <= 1 MiB). The CUDA wheel the lab
    pins has no such kernel, so on a CPU with AMX vLLM's post-load step raised AttributeError
    (convert_weight_packed) and on one without it took the torch.nn.functional.linear fallback.
    Where the build lacks the route, vLLM's own predicate answers False for it: every processor
    then gets the route this build can run (oneDNN where registered, else the torch fallback).
    A build that has the route (vLLM's CPU build) is left exactly as vLLM made it.
    """
    if vllm_has_amx_gemm():
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_layer_utils, "check_cpu_sgl_kernel", lambda n, k, dtype: False)
        yield


def vllm_post_load(model, model_config) -> None:
    """vLLM's process_weights_after_loading on the CPU, with the GEMM routes this vLLM build has."""
    with gemm_routes_of_this_build():
        process_weights_after_loading(model, model_config, torch.device("cpu"))


def vllm_gemm_layers(model) -> dict[str, torch.nn.Module]:
    """Every layer to which vLLM's CPU dispatch gave a GEMM route (``cpu_linear``)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "cpu_linear")}


# --- a one-process vLLM world, and the drafter built inside it ---------------------------


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    """World size 1, rank 0, gloo over a file:// rendezvous (no network)."""
    assert current_platform.is_cpu(), (
        f"vLLM picked the {type(current_platform).__name__}; run the interop test with VLLM_TARGET_DEVICE=cpu"
    )
    ours = not model_parallel_is_initialized()
    if ours:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('gloo') / 'rendezvous'}")
            initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    if ours:
        destroy_model_parallel()
        destroy_distributed_environment()


def stand_in_vllm_config(draft_hf_config, *, target_layers: int, target_hidden: int, target_vocab: int,
                         dtype: torch.dtype) -> VllmConfig:
    """A default VllmConfig whose target model config and speculative config are minimal stand-ins.

    They provide exactly what DFlashLagunaForCausalLM's constructor and vLLM's
    post-load step read; a missing attribute fails with its name.
    """
    vc = VllmConfig()
    vc.compilation_config.mode = CompilationMode.NONE  # eager, as with --enforce-eager
    vc.model_config = SimpleNamespace(  # the TARGET's model config
        dtype=dtype, head_dtype=dtype, quantization=None, is_moe=False, is_mm_prefix_lm=False,
        rswa_window=None, word_embeddings_untied_by_checkpoint=False,
        get_hidden_size=lambda: target_hidden,
        get_total_num_hidden_layers=lambda: target_layers,
        get_vocab_size=lambda: target_vocab,
    )
    vc.speculative_config = SimpleNamespace(
        method="dflash", num_speculative_tokens=draft_hf_config.dflash_config["block_size"] - 1,
        enable_adaptive_verification=False,
        draft_model_config=SimpleNamespace(hf_config=draft_hf_config, quantization=None),
    )
    return vc


@pytest.fixture
def vllm_pair(vllm_world, make_drafter, tmp_path):
    """Factory: (our drafter, vLLM's DFlashLagunaForCausalLM loaded from our checkpoint, details)."""

    def build(layers=2, layer_type="full_attention", gating=True, *, dtype=torch.float32, seed=0):
        ours = make_drafter(layers, layer_type, gating, seed=seed, dtype=dtype)
        ckpt = tmp_path / f"ckpt-{layers}-{layer_type}-{gating}-{dtype}".replace("torch.", "")
        save_drafter(ours, ckpt)
        hf = get_config(ckpt, trust_remote_code=False)  # vLLM's own reader of our config.json
        cfg = ours.config
        vc = stand_in_vllm_config(hf, target_layers=cfg.target_layer_count, target_hidden=cfg.target_hidden_size,
                                  target_vocab=cfg.draft_vocab_size, dtype=dtype)
        with set_current_vllm_config(vc), set_default_torch_dtype(dtype):
            model = DFlashLagunaForCausalLM(vllm_config=vc)
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            loaded = model.load_weights(safetensors_weights_iterator([str(ckpt / "model.safetensors")], False))
            vllm_post_load(model, vc.model_config)
        return ours, model, SimpleNamespace(vllm_config=vc, loaded=set(loaded), shapes=shapes, ckpt=ckpt, hf=hf)

    return build


def vllm_context_kv(model, vllm_config, states, positions):
    """Run vLLM's precompute_and_store_context_kv and capture what it writes into each layer's KV cache."""
    written = {}

    class CaptureCacheWrite:
        def __init__(self, layer):
            self.layer = layer

        def do_kv_cache_update(self, attn, k, v, kv_cache, slot_mapping):
            written[self.layer] = (k.clone(), v.clone())

    inner = model.model
    inner._attn_layers = [SimpleNamespace(kv_cache=None, impl=CaptureCacheWrite(i)) for i in range(len(inner.layers))]
    with set_current_vllm_config(vllm_config), torch.no_grad():
        model.precompute_and_store_context_kv(states, positions, torch.arange(len(positions)))
    return torch.stack([written[i][0] for i in range(len(written))]), torch.stack([written[i][1] for i in range(len(written))])


class VllmNativeKernels:
    """Stand-ins for vLLM's two compiled ops, built from vLLM's native implementations."""

    @staticmethod
    def rms_norm(out, x, weight, eps):
        # The kernel picks the weight row by the outermost index when the weight has
        # leading dims ([L, H] for [L, N, H]; [L, hd] for [L, N, nkv, hd]).
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        w = weight.reshape(weight.shape[:-1] + (1,) * (x.dim() - weight.dim()) + weight.shape[-1:])
        out.copy_(normed * w)

    @staticmethod
    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, cos_sin_cache.shape[-1],
                                              cos_sin_cache, is_neox)
        query.copy_(q)  # the kernel works in place
        if key is not None:
            key.copy_(k)


def context(n, hidden=64, *, seed=1, start=0):
    g = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(n, hidden, generator=g) + 0.5, torch.arange(start, start + n)


# --- loading --------------------------------------------------------------------------


@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_vllm_builds_the_same_parameters(vllm_pair, layers, layer_type, gating):
    ours, _, vllm = vllm_pair(layers, layer_type, gating)
    expected = {f"model.{n}": tuple(t.shape) for n, t in ours.state_dict().items()}
    assert {n: s for n, s in vllm.shapes.items() if n not in SHARED_WITH_TARGET} == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_vllm_loads_every_tensor_and_they_equal_ours(vllm_pair, layers, layer_type, gating, dtype):
    ours, model, vllm = vllm_pair(layers, layer_type, gating, dtype=dtype)
    params = dict(model.named_parameters())
    # vLLM's DefaultModelLoader refuses a model with parameters the checkpoint did not initialise.
    assert set(params) - vllm.loaded == set()
    assert vllm.loaded - SHARED_WITH_TARGET == {f"model.{n}" for n in ours.state_dict()}
    for name, tensor in ours.state_dict().items():
        theirs = params[f"model.{name}"]
        assert theirs.dtype == dtype and torch.equal(theirs.data, tensor), name


def test_vllm_picks_its_cpu_gemm_route_from_the_processor_not_the_build(vllm_world, make_drafter, tmp_path, monkeypatch):
    """Why vllm_post_load exists: on a CPU with AMX, vLLM's own post-load step reaches for its AMX
    kernel, which a build without it (the CUDA wheel the lab pins) cannot run."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    ours = make_drafter(2, dtype=torch.bfloat16)
    save_drafter(ours, tmp_path / "ckpt")
    hf = get_config(tmp_path / "ckpt", trust_remote_code=False)
    cfg = ours.config
    vc = stand_in_vllm_config(hf, target_layers=cfg.target_layer_count, target_hidden=cfg.target_hidden_size,
                              target_vocab=cfg.draft_vocab_size, dtype=torch.bfloat16)
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        model = DFlashLagunaForCausalLM(vllm_config=vc)
        model.load_weights(safetensors_weights_iterator([str(tmp_path / "ckpt" / "model.safetensors")], False))
        if vllm_has_amx_gemm():  # vLLM's CPU build: the route exists and vLLM takes it
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        else:
            with pytest.raises(AttributeError, match="convert_weight_packed"):
                process_weights_after_loading(model, vc.model_config, torch.device("cpu"))


def test_vllm_post_load_is_the_same_with_and_without_amx(vllm_pair, monkeypatch):
    """bf16 (the dtype vLLM's AMX route is for), the processor reporting AMX tiles and not: vLLM's own
    predicate would pick the AMX route for some layers only in the first case; with the build's routes,
    both load every tensor bit for bit, keep every weight, and compute the same bits."""
    seen = {}
    for amx in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
            ours, model, vllm = vllm_pair(2, "full_attention", True, dtype=torch.bfloat16)
            gemms = vllm_gemm_layers(model)
            aux = 4.0 * torch.randn(9, len(ours.config.target_layer_ids) * ours.config.target_hidden_size,
                                    generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            # vLLM's own choice on this processor (undone above only where the build lacks the kernel)
            wanted_amx = [n for n, m in gemms.items()
                          if vllm_layer_utils.check_cpu_sgl_kernel(*m.weight.shape, m.weight.dtype)]
            assert bool(wanted_amx) == amx, wanted_amx
            params = dict(model.named_parameters())
            for name, tensor in ours.state_dict().items():
                assert torch.equal(params[f"model.{name}"].data, tensor), name
            for name, m in gemms.items():
                assert m.weight.numel() > 0, f"{name}: vLLM dropped the weight for a packed copy"
                if f"{name}.weight" in SHARED_WITH_TARGET:  # not in the drafter's checkpoint: uninitialised here
                    continue
                inputs = torch.randn(3, m.weight.shape[1], generator=torch.Generator().manual_seed(7)).to(m.weight.dtype)
                assert torch.equal(m.cpu_linear(inputs, m.weight, getattr(m, "bias", None)),
                                   F.linear(inputs, m.weight, getattr(m, "bias", None))), name
            with set_current_vllm_config(vllm.vllm_config), torch.no_grad():
                seen[amx] = model.combine_hidden_states(aux)
    assert torch.equal(seen[True], seen[False])
    with torch.no_grad():
        torch.testing.assert_close(seen[True], ours.combine_hidden_states(aux), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_vllm_reads_our_config_the_same_way(vllm_pair, layers, layer_type, gating):
    ours, model, vllm = vllm_pair(layers, layer_type, gating)
    cfg = ours.config
    assert type(vllm.hf).__name__ == "LagunaConfig"
    assert [l.self_attn.attn.layer_name for l in model.model.layers] == ours.attention_layer_names()
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.sliding_window == cfg.window  # the compute-time window ...
        assert attn.attn.sliding_window is None  # ... over a full-attention KV store
        assert attn.gate_per_head == cfg.gate_per_head
        assert (attn.rotary_emb.rotary_dim, attn.rotary_emb.base) == (cfg.rotary_dim, cfg.rope["rope_theta"])
        assert attn.rotary_emb.is_neox_style  # Laguna rotates halves, as our apply_rope does
    assert model.model.mask_token_id == cfg.mask_token_id
    assert model.model.num_aux_slices == len(cfg.target_layer_ids)


def test_vllm_rejects_a_vocab_mismatch_as_we_do(vllm_world, make_drafter, tmp_path):
    ours = make_drafter(1)
    save_drafter(ours, tmp_path / "ckpt")
    vc = stand_in_vllm_config(get_config(tmp_path / "ckpt", trust_remote_code=False), target_layers=6,
                              target_hidden=64, target_vocab=4096, dtype=torch.float32)
    with set_current_vllm_config(vc), pytest.raises(ValueError, match="draft_vocab_size"):
        DFlashLagunaForCausalLM(vllm_config=vc)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        ours.config.validate_against_target({"vocab_size": 4096, "num_hidden_layers": 6, "hidden_size": 64})


# --- numerics (float32) ---------------------------------------------------------------------


@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_combine_hidden_states_matches_vllm(vllm_pair, layers, layer_type, gating):
    ours, model, vllm = vllm_pair(layers, layer_type, gating)
    aux = 4.0 * torch.randn(9, len(ours.config.target_layer_ids) * ours.config.target_hidden_size,
                            generator=torch.Generator().manual_seed(5))
    with set_current_vllm_config(vllm.vllm_config), torch.no_grad():
        theirs, theirs_one = model.combine_hidden_states(aux), model.combine_hidden_states(aux[0])
        mine = ours.combine_hidden_states(aux)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine[0], theirs_one, atol=1e-5, rtol=1e-5)


def assert_context_kv_matches(ours, theirs_k, theirs_v, states, positions):
    L, N = len(ours.layers), len(positions)
    assert theirs_k.shape == theirs_v.shape == (L, N, ours.config.num_key_value_heads, ours.config.head_dim)
    for path in CONTEXT_KV_PATHS:
        k, v = ours.precompute_context_kv(states, positions, path=path)
        torch.testing.assert_close(k, theirs_k, atol=1e-5, rtol=0, msg=lambda m: f"K, {path} path: {m}")
        torch.testing.assert_close(v, theirs_v, atol=1e-5, rtol=0, msg=lambda m: f"V, {path} path: {m}")


@pytest.mark.skipif(not vllm_kernels_available(), reason=(
    "vLLM's compiled CPU ops (torch.ops._C.rms_norm / rotary_embedding) are not in this vLLM build; "
    "test_context_kv_matches_vllm_precompute_with_native_kernels covers the rest of the precompute"))
@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_context_kv_matches_vllm_precompute_with_its_kernels(vllm_pair, layers, layer_type, gating):
    ours, model, vllm = vllm_pair(layers, layer_type, gating)
    states, positions = context(33, start=4)
    assert_context_kv_matches(ours, *vllm_context_kv(model, vllm.vllm_config, states, positions), states, positions)


@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_context_kv_matches_vllm_precompute_with_native_kernels(vllm_pair, monkeypatch, layers, layer_type, gating):
    ours, model, vllm = vllm_pair(layers, layer_type, gating)
    for module in (laguna_dflash, qwen3_dflash):  # where precompute_and_store_context_kv finds `ops`
        monkeypatch.setattr(module, "ops", VllmNativeKernels)
    states, positions = context(33, start=4)
    assert_context_kv_matches(ours, *vllm_context_kv(model, vllm.vllm_config, states, positions), states, positions)


class StandInAttention(torch.nn.Module):
    """What vLLM's attention backend computes for a DFlash block: the block's queries over
    [context K/V already in the cache ; the block's own K/V], non-causal, windowed."""

    def __init__(self, ctx_k, ctx_v, mask, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.ctx_k, self.ctx_v, self.mask = ctx_k, ctx_v, mask
        self.shape = (num_heads, num_kv_heads, head_dim)

    def forward(self, q, k, v):  # (Q, nh*hd), (Q, nkv*hd), (Q, nkv*hd)
        nh, nkv, hd = self.shape
        Q = q.shape[0]
        keys = torch.cat([self.ctx_k, k.view(Q, nkv, hd)]).transpose(0, 1)  # (nkv, N+Q, hd)
        values = torch.cat([self.ctx_v, v.view(Q, nkv, hd)]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.view(Q, nh, hd).transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=self.mask[None, None], scale=hd**-0.5, enable_gqa=nh != nkv)
        return out[0].transpose(0, 1).reshape(Q, nh * hd)


@pytest.mark.parametrize("layers,layer_type,gating", CASES)
def test_block_forward_matches_vllm(vllm_pair, monkeypatch, layers, layer_type, gating):
    ours, model, vllm = vllm_pair(layers, layer_type, gating)
    cfg = ours.config
    for module in (laguna_dflash, qwen3_dflash):
        monkeypatch.setattr(module, "ops", VllmNativeKernels)
    states, ctx_positions = context(20)  # context 0..19; with the sliding window 8 the block sees 13..19 at most
    ctx_k, ctx_v = vllm_context_kv(model, vllm.vllm_config, states, ctx_positions)
    block_size = cfg.block_size
    positions = torch.arange(20, 20 + block_size)
    embeds = torch.randn(block_size, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    for j, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        window, causal = qwen3_dflash._resolve_layer_attention(vllm.hf, j)  # vLLM's own rule for this layer
        assert (window, causal) == (cfg.window, cfg.is_causal)
        mask = dflash_attention_mask(positions[None], ctx_positions, block_size, window, causal=causal)[0]
        layer.self_attn.attn = StandInAttention(ctx_k[j], ctx_v[j], mask, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    with set_current_vllm_config(vllm.vllm_config), torch.no_grad():
        theirs = model(input_ids=None, positions=positions, inputs_embeds=embeds)
        mine = ours(embeds[None], positions[None], ctx_k, ctx_v, ctx_positions)[0]
    assert theirs.shape == (block_size, cfg.hidden_size)
    assert (theirs - embeds).abs().max() > 0.1  # the layers did something
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
