"""A speed model for DFlash, checked where the answer is known: Poolside's cards and the lab's own pair.

At batch 1 each DFlash step emits tau tokens (the mean acceptance length) for one drafter
step and one target forward over the block; target-only decoding emits one token per
target forward. Hence

    speedup = tau x T_target(1) / (T_target(B) + T_drafter(B))        B = num_speculative_tokens + 1

It leaves out: the engine's own per-step work (scheduling, sampling, acceptance, KV
bookkeeping, outside both forwards), tensor parallelism (Poolside's S-2.1 rows run at TP=2:
every step also pays all-reduces), quantization (INT4/FP8/NVFP4 weights change the bytes a
step reads and how the cost grows with B), and concurrency (at c > 1 one target forward
carries c sequences' blocks, more tokens and more distinct experts, and sequences finish
unevenly). Two sets of step costs are used, both Laguna-XS.2 at its true shape on one H200
(``benchmarks/xs2_steps.json``): the lab's measured graphed steps ("measured") and their
bytes floors ("floor": an engine at the memory bandwidth). Laguna-S-2.1 (118 B) was not
measured: its rows reuse XS.2's cost ratio T_target(1) / (T_target(B) + T_drafter(B)) as is,
which assumes the same growth of a step with its block (same family, 8 of 256 experts; S-2.1
is wider) and is labelled so in every row.

For the lab's pair (``benchmarks/spec_decode.json``) the same formula runs on its measured
whole-step times per batch (one batch step of target-only decoding vs one DFlash step) and,
at batch 1, on the forward phases alone (verify + draft), beside the measured speed-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..poolside_cards import CARDS

ROOT = Path(__file__).resolve().parents[2]
XS2_STEPS = ROOT / "benchmarks" / "xs2_steps.json"
SPEC_DECODE = ROOT / "benchmarks" / "spec_decode.json"


def predicted_speedup(tau: float, t_target_1: float, t_target_block: float, t_drafter_block: float) -> float:
    """tau x T_target(1) / (T_target(B) + T_drafter(B)); times in any one unit."""
    if min(t_target_1, t_target_block, t_drafter_block) < 0 or t_target_block + t_drafter_block <= 0:
        raise ValueError("step times must be non-negative and T_target(B) + T_drafter(B) positive")
    return tau * t_target_1 / (t_target_block + t_drafter_block)


def step_costs(steps: dict, block: int) -> dict:
    """{"measured": (T1, TB, TD), "floor": (T1, TB, TD)} in ms from an xs2_steps record, for ``block``."""
    target = {t["block"]: t for t in steps["target"]}
    drafter = {d["block"]: d for d in steps["drafter"]}
    if block not in target or block not in drafter or 1 not in target:
        raise KeyError(f"xs2_steps has no target step at 1 and {block} tokens and drafter step at {block}")
    return {"measured": (target[1]["ms"], target[block]["ms"], drafter[block]["ms"]),
            "floor": (target[1]["floor_ms"], target[block]["floor_ms"], drafter[block]["floor_ms"])}


def poolside_table(steps: dict | None = None, cards=CARDS, concurrency=(None, 1, 16)) -> list[dict]:
    """Every card row at the given concurrencies: published speed-up beside the predicted ones and their ratios."""
    steps = steps if steps is not None else json.loads(XS2_STEPS.read_text())
    rows = []
    for card in cards:
        costs = step_costs(steps, card["num_speculative_tokens"] + 1)
        measured_on = "Laguna-XS.2" if card["target_params_b"] < 50 else "Laguna-XS.2's ratio (S-2.1 not measured)"
        for r in card["rows"]:
            if r["concurrency"] not in concurrency:
                continue
            row = {"card": card["card"], "quantization": card["quantization"], "benchmark": r["benchmark"],
                   "concurrency": r["concurrency"], "tensor_parallel": card["tensor_parallel"], "tau": r["tau"],
                   "published": r["speedup"], "costs_from": measured_on, "url": card["url"]}
            for kind, (t1, tb, td) in costs.items():
                pred = predicted_speedup(r["tau"], t1, tb, td)
                row[f"predicted_{kind}"] = round(pred, 3)
                row[f"ratio_{kind}"] = round(pred / r["speedup"], 3)
            rows.append(row)
    return rows


def lab_pair_table(spec: dict | None = None, prompt_set: str = "heldout", method: str = "dflash") -> list[dict]:
    """The lab's own pair: predicted (from its measured step times) beside measured speed-up, per batch and block."""
    spec = spec if spec is not None else json.loads(SPEC_DECODE.read_text())
    recs = [r for r in spec["records"] if r.get("prompt_set", "heldout") == prompt_set and r.get("cuda_graphs")]
    base = {r["batch"]: r for r in recs if r["method"] == "target_only"}
    phases = spec.get("phases", {})
    rows = []
    for r in sorted((r for r in recs if r["method"] == method), key=lambda r: (r["batch"], r["block_size"])):
        b = base.get(r["batch"])
        if b is None or not r.get("mean_acceptance_length"):
            continue
        tau = r["mean_acceptance_length"]
        pred = tau * b["ms_per_batch_step"] / r["ms_per_batch_step"]  # target-only step vs DFlash step, whole
        row = {"pair": "shipped", "method": method, "batch": r["batch"], "block": r["block_size"], "tau": tau,
               "measured": round(r["tokens_per_s"] / b["tokens_per_s"], 3),
               "T_target_only_step_ms": b["ms_per_batch_step"], "T_dflash_step_ms": r["ms_per_batch_step"],
               "predicted": round(pred, 3)}
        row["ratio"] = round(row["predicted"] / row["measured"], 3)
        ph, base_ph = phases.get(method), phases.get("target_only")
        if r["batch"] == 1 and ph and base_ph and ph.get("block_size") == r["block_size"]:
            forwards = predicted_speedup(tau, base_ph["verify_ms_per_step"], ph["verify_ms_per_step"],
                                         ph["draft_ms_per_step"])
            row["predicted_forwards_only"] = round(forwards, 3)
        rows.append(row)
    return rows
