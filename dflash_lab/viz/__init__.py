"""Figures for the lab: functions that take plain data and return a plotly Figure.

One module per chapter of the notebook suite. Functions here never compute
model outputs themselves; they draw what they are given.

    common      the palette, one colour per method, titles that fit, save_figure (SVG/HTML)
    drafter     chapter 1: the visibility mask and the drafter's parameters
    context_kv  chapter 2: context K/V norms and each path's error
    acceptance  chapter 3: per-position acceptance, sweeps, coloured tokens
    step_through  chapters 1 and 3: one draft -> verify -> accept step as a table
    kv_groups   chapter 4: hybrid KV-cache groups and their memory
    kernels     chapter 5: context-K/V timings and acceptance per sliding window
    training    training logs (loss curves, per-position agreement)
    training_live  chapter 6: a drafter's loss and held-out acceptance while it trains
    verification  chapter 7: verification rules side by side (per-position rates, τ intervals)
    serving     chapter 8: the straggler effect, static against continuous batching, speed-up against concurrency
    tree        chapter 9: one draft tree (DDTree), τ against the node budget, speed and verify cost per budget
"""

from dflash_lab.viz.common import (METHOD_COLOR_NAMES, METHOD_COLORS, PALETTE, answer_table, html_table, method_color,
                                   save_figure)
from dflash_lab.viz.drafter import (
    PARAMETER_GROUPS,
    layer_table_html,
    parameter_bars_figure,
    parameter_table_html,
    rope_table_html,
    visibility_mask_figure,
)
from dflash_lab.viz.context_kv import (
    context_kv_head_norms_figure,
    context_kv_norms_figure,
    context_kv_path_figure,
    k_norm_effect_figure,
)
from dflash_lab.viz.acceptance import (
    TOKEN_COLORS,
    acceptance_length_histogram,
    acceptance_sweep_figure,
    acceptance_tokens_html,
    acceptance_vs_block_size_figure,
    acceptance_vs_temperature_figure,
    compare_acceptance_figure,
    engine_vs_lab_figure,
    per_position_acceptance_figure,
    tau_vs_speedup_figure,
)
from dflash_lab.viz.step_through import step_through_html, step_verdicts
from dflash_lab.viz.kv_groups import (KV_KIND_COLORS, kv_group_layout_figure, kv_group_memory_figure,
                                      kv_group_memory_table_html, kv_padding_figure)
from dflash_lab.viz.kernels import CONTEXT_KV_PATH_STYLE, context_kv_timing_figure, window_acceptance_figure
from dflash_lab.viz.training import plot_training_log, read_training_log
from dflash_lab.viz.speed import speedup_vs_tau_figure, step_time_figure  # noqa: F401  (chapter 5: measured speed)
from dflash_lab.viz.training_live import drafter_comparison_figure, live_training_figure, update_live_training_figure
from dflash_lab.viz.verification import tau_interval_figure, verification_rates_figure
from dflash_lab.viz.serving import serving_speedup_figure, serving_time_figure, straggler_figure
from dflash_lab.viz.tree import (draft_tree_figure, tau_vs_budget_figure, tree_data, tree_speed_figure, tree_speedups,
                                 where_tree_stops_paying)

__all__ = [
    "PALETTE", "METHOD_COLORS", "METHOD_COLOR_NAMES", "method_color", "save_figure",
    "PARAMETER_GROUPS", "answer_table", "html_table", "layer_table_html", "parameter_bars_figure",
    "parameter_table_html",
    "rope_table_html", "visibility_mask_figure",
    "context_kv_head_norms_figure", "context_kv_norms_figure", "context_kv_path_figure", "k_norm_effect_figure",
    "TOKEN_COLORS", "acceptance_length_histogram", "acceptance_sweep_figure", "acceptance_tokens_html",
    "acceptance_vs_block_size_figure", "acceptance_vs_temperature_figure", "compare_acceptance_figure",
    "per_position_acceptance_figure", "tau_vs_speedup_figure", "engine_vs_lab_figure",
    "step_through_html", "step_verdicts",
    "KV_KIND_COLORS", "kv_group_layout_figure", "kv_group_memory_figure", "kv_group_memory_table_html",
    "kv_padding_figure",
    "CONTEXT_KV_PATH_STYLE", "context_kv_timing_figure", "window_acceptance_figure",
    "plot_training_log", "read_training_log",
    "drafter_comparison_figure", "live_training_figure", "update_live_training_figure",
    "tau_interval_figure", "verification_rates_figure",
    "draft_tree_figure", "tau_vs_budget_figure", "tree_data", "tree_speed_figure", "tree_speedups",
    "where_tree_stops_paying",
]
