import torch, sys
from dflash_lab.assets import load_default_pair
from dflash_lab.spec_decode.fast.static_target import StaticTarget
from dflash_lab.tools.bench_spec_decode import prompt_ids
t32, _, tok = load_default_pair("cuda", dtype=torch.float32)
t16 = load_default_pair("cuda", dtype=torch.bfloat16)[0]
prompts = [p[0] for p in prompt_ids(tok, "heldout", 8, 160, "cuda")]
res = {"fused": [0, 0, 0.0], "sdpa": [0, 0, 0.0]}
with torch.no_grad():
    for p in prompts:
        T = p.shape[0]; ctx = T - 48
        ref = StaticTarget(t32, batch=1, capacity=T + 16)
        full, _ = ref.forward(p[None], torch.arange(T, device="cuda")[None])
        for name, fused in (("fused", True), ("sdpa", False)):
            st = StaticTarget(t16, batch=1, capacity=T + 16, fused_attention=fused)
            st.forward(p[None, :ctx], torch.arange(ctx, device="cuda")[None])
            for i in range(ctx, T, 16):  # blocks of 16 and single tokens, teacher-forced
                lg, _ = st.forward(p[None, i:i + 16], torch.arange(i, i + 16, device="cuda")[None])
                r = full[0, i:i + 16]
                res[name][0] += int((lg[0].argmax(-1) == r.argmax(-1)).sum()); res[name][1] += 16
                res[name][2] += float((lg[0].float() - r).abs().mean())
for k, (a, n, e) in res.items():
    print(f"bf16 {k}: argmax equal to float32 {a}/{n}, mean |logit - float32| {e / (n / 16):.5f}")
