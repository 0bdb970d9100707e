"""Controls for the lab: ipywidgets wired to the figure functions in ``dflash_lab.viz``.

Widgets hold no logic of their own: each control re-runs a package function
and hands the result to a viz function. One module per chapter:

    common      the dtypes offered and redrawing a FigureWidget in place
    drafter     chapter 1: drafter_config_explorer
    context_kv  chapter 2: context_kv_path_explorer, sliding_window_explorer
    acceptance  chapter 3: acceptance_explorer
    step_through chapters 1 and 3: step_through (a step slider over one generation)
    kv_groups   chapter 4: kv_groups_explorer
    kernels     chapter 5: fused_kernel_explorer, window_acceptance_explorer
    training    chapter 6: drafter_training_explorer
    verification chapter 7: verification_explorer
    serving     chapter 8: straggler_explorer
    tree        chapter 9: draft_tree_explorer (and replay_block, one tree step again at other budgets)
"""

from dflash_lab.widgets.common import CONTEXT_KV_DTYPES
from dflash_lab.widgets.drafter import drafter_config_explorer
from dflash_lab.widgets.context_kv import context_kv_path_explorer, sliding_window_explorer
from dflash_lab.widgets.acceptance import acceptance_explorer
from dflash_lab.widgets.step_through import step_through
from dflash_lab.widgets.kv_groups import kv_groups_explorer
from dflash_lab.widgets.kernels import fused_kernel_explorer, window_acceptance_explorer
from dflash_lab.widgets.training import drafter_training_explorer
from dflash_lab.widgets.verification import verification_explorer
from dflash_lab.widgets.serving import straggler_explorer
from dflash_lab.widgets.tree import draft_tree_explorer, replay_block

__all__ = [
    "CONTEXT_KV_DTYPES",
    "drafter_config_explorer",
    "context_kv_path_explorer", "sliding_window_explorer",
    "acceptance_explorer", "step_through",
    "kv_groups_explorer",
    "fused_kernel_explorer", "window_acceptance_explorer",
    "drafter_training_explorer",
    "verification_explorer",
    "straggler_explorer",
    "draft_tree_explorer", "replay_block",
]
