"""Poolside's published DFlash speed-ups, as their model cards state them (rows and conditions, with addresses).

Each card row: benchmark, concurrency, mean acceptance length tau (tokens per verification
step, vLLM's definition) and the throughput speed-up over the same target without a
speculator. ``measure.speed_model`` predicts the speed-ups from tau and the lab's measured
step costs and sets them beside these.

Laguna-XS-2.1-DFlash (BF16): the four rows quoted in the lab's issue 32 from the card's
"Evaluation" section (the stored copy of the card we could read stops at that heading, so its
concurrency and tensor-parallel size are not recorded here). Laguna-S-2.1-DFlash INT4 / FP8 /
NVFP4: the cards' full tables, "Measured with TP=2, temperature=0, and num_speculative_tokens=15",
at concurrency 1, 4, 8 and 16.
"""

from __future__ import annotations

S21_BENCHMARKS = ("GSM8K", "MATH-500", "HumanEval", "MBPP", "MT-Bench")
S21_CONCURRENCY = (1, 4, 8, 16)


def _s21_rows(speedups: tuple, taus: tuple) -> list[dict]:
    rows = []
    for c, sp_row, tau_row in zip(S21_CONCURRENCY, speedups, taus):
        for bench, sp, tau in zip(S21_BENCHMARKS, sp_row, tau_row):
            rows.append({"benchmark": bench, "concurrency": c, "tau": tau, "speedup": sp})
    return rows


CARDS: list[dict] = [
    {
        "card": "poolside/Laguna-XS-2.1-DFlash",
        "url": "https://huggingface.co/poolside/Laguna-XS-2.1-DFlash",
        "target": "Laguna-XS-2.1", "target_params_b": 33, "quantization": "BF16", "drafter_layers": 5,
        "num_speculative_tokens": 15, "tensor_parallel": None, "temperature": None,
        "conditions": "BF16 target and drafter, up to 15 speculative tokens per step; concurrency and TP not "
                      "in the copy we read",
        "rows": [
            {"benchmark": "GSM8K", "concurrency": None, "tau": 3.55, "speedup": 1.67},
            {"benchmark": "HumanEval", "concurrency": None, "tau": 4.57, "speedup": 2.64},
            {"benchmark": "EvalPlus", "concurrency": None, "tau": 4.10, "speedup": 1.97},
            {"benchmark": "Math", "concurrency": None, "tau": 4.40, "speedup": 1.90},
        ],
    },
    {
        "card": "poolside/Laguna-S-2.1-DFlash-INT4",
        "url": "https://huggingface.co/poolside/Laguna-S-2.1-DFlash-INT4",
        "target": "Laguna-S-2.1-INT4", "target_params_b": 118, "quantization": "INT4", "drafter_layers": 6,
        "num_speculative_tokens": 15, "tensor_parallel": 2, "temperature": 0.0,
        "conditions": "Measured with TP=2, temperature=0, and num_speculative_tokens=15",
        "rows": _s21_rows(((3.697, 3.216, 3.776, 2.704, 2.525), (2.815, 2.521, 2.995, 2.145, 1.980),
                           (2.541, 2.247, 2.865, 1.970, 1.953), (2.426, 2.161, 2.629, 1.895, 1.935)),
                          ((6.273, 5.363, 6.416, 4.532, 4.217), (6.111, 5.336, 6.416, 4.498, 4.154),
                           (6.133, 5.356, 6.777, 4.565, 4.383), (6.145, 5.393, 6.314, 4.507, 4.636))),
    },
    {
        "card": "poolside/Laguna-S-2.1-DFlash-FP8",
        "url": "https://huggingface.co/poolside/Laguna-S-2.1-DFlash-FP8",
        "target": "Laguna-S-2.1-FP8", "target_params_b": 118, "quantization": "FP8", "drafter_layers": 6,
        "num_speculative_tokens": 15, "tensor_parallel": 2, "temperature": 0.0,
        "conditions": "Measured with TP=2, temperature=0, and num_speculative_tokens=15",
        "rows": _s21_rows(((3.179, 2.938, 3.269, 2.380, 2.603), (2.614, 2.423, 2.691, 1.963, 2.090),
                           (2.666, 2.410, 2.803, 1.962, 2.230), (2.618, 2.364, 2.866, 2.031, 2.302)),
                          ((5.748, 5.197, 5.889, 4.247, 4.663), (5.765, 5.212, 5.882, 4.218, 4.411),
                           (5.863, 5.199, 6.094, 4.178, 4.572), (5.787, 5.161, 6.144, 4.291, 4.600))),
    },
    {
        "card": "poolside/Laguna-S-2.1-DFlash-NVFP4",
        "url": "https://huggingface.co/poolside/Laguna-S-2.1-DFlash-NVFP4",
        "target": "Laguna-S-2.1-NVFP4", "target_params_b": 118, "quantization": "NVFP4", "drafter_layers": 6,
        "num_speculative_tokens": 15, "tensor_parallel": 2, "temperature": 0.0,
        "conditions": "Measured with TP=2, temperature=0, and num_speculative_tokens=15",
        "rows": _s21_rows(((3.324, 2.893, 3.692, 2.426, 2.338), (2.498, 2.174, 2.742, 1.848, 1.831),
                           (2.279, 1.948, 2.634, 1.719, 1.772), (2.302, 1.965, 2.626, 1.731, 1.672)),
                          ((5.775, 4.942, 6.438, 4.171, 4.017), (5.804, 4.935, 6.298, 4.161, 4.091),
                           (5.719, 4.885, 6.537, 4.193, 4.373), (5.758, 4.896, 6.412, 4.123, 3.981))),
    },
]
