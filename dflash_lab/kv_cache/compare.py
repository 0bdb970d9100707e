"""The seed's draft-group rules beside vLLM 0.33 itself: one table of where they differ.

``groups.kv_cache_groups(..., rules=...)`` flags draft groups three ways; the table sets the
first beside the last:

    "seed"       as the seed patch's own test file states them: the rules run for every
                 EAGLE-family method (its ``test_deepseek_v4_draft_group_annotated_on_packed_path``
                 flags dspark's group), and the warning is called after every annotation
                 (the seed's ``get_kv_cache_groups`` / ``_get_packed_kv_cache_groups`` call
                 ``_warn_if_unannotated_eagle_mamba`` unconditionally; its
                 ``test_non_mtp_eagle_hybrid_still_warns`` expects eagle, eagle3 and dspark
                 on the Qwen3.5 hybrid to warn)
    "seed-gated" the same rules behind 0.33's gate (below); not in the table
    "vllm-0.33"  0.33's own ``get_global_kv_cache_groups``, run: annotation and warning only
                 under ``use_eagle_block_drop()`` (``kv_cache_planning.py:1650-1656``), False for
                 dflash and dspark (``config/speculative.py:2122-2149``), and there the
                 ``is_draft`` marker alone: no trailing-layer rule, so an unmarked MTP or
                 DeepSeek-V4 drafter is not found (0.33's runtime marks every drafter layer)

Both warn only when no group is flagged and some group holds Mamba state
(``kv_cache_planning.py:1057-1065``). ``rule_table`` runs both on the chapter's models for
every EAGLE-family method.
"""

from __future__ import annotations

from typing import NamedTuple

from dflash_lab.kv_cache import groups as kv, presets as kv_presets, specs as kv_specs

# label -> (spec builder, the target's model_type, layout). The DeepSeek shape runs on the
# packed path, as the seed's DeepSeek-V4 test does.
MODELS = {
    "Laguna-XS.2 + DFlash": (lambda: kv_presets.preset_specs("laguna_xs2_dflash"), "laguna", "LBHNC"),
    "Qwen3.5 hybrid, unmarked": (kv_specs.qwen3_5_hybrid_specs, "qwen3_5", "LBHNC"),
    "Qwen3.5 hybrid, marked": (lambda: kv_specs.qwen3_5_hybrid_specs(mark_draft=True), "qwen3_5", "LBHNC"),
    "DeepSeek-V4, unmarked": (kv_specs.deepseek_v4_specs, "deepseek_v4", "BLHNC"),
    "DeepSeek-V4, marked": (lambda: kv_specs.deepseek_v4_specs(mark_draft=True), "deepseek_v4", "BLHNC"),
    "DeepSeek-V4.1, unmarked": (kv_specs.deepseek_v4_specs, "deepseek_v41", "BLHNC"),
}
WHY_FLAGS = ("seed: the rules run for every EAGLE-family method | 0.33: only under use_eagle_block_drop(), "
             "False for dflash and dspark (kv_cache_planning.py:1650-1656; config/speculative.py:2122-2149)")
WHY_WARNING = ("seed: the warning follows every annotation (seed test_non_mtp_eagle_hybrid_still_warns) | "
               "0.33: only inside the block-drop branch (kv_cache_planning.py:1656)")
WHY_TRAILING = ("seed: #55390's trailing-layer rule flags the group of the last registered layer (mtp anywhere, "
                "every EAGLE method on DeepSeek V4/V4.1) | 0.33: the is_draft marker only "
                "(kv_cache_planning.py:1651-1655), and the warning where that finds nothing beside Mamba (:1057-1065)")


class RuleRow(NamedTuple):
    model: str
    method: str
    seed_flags: list[str]  # flagged groups, "g0", "g1", ...
    seed_warns: bool
    vllm_flags: list[str]
    vllm_warns: bool

    @property
    def differs(self) -> bool:
        return (self.seed_flags, self.seed_warns) != (self.vllm_flags, self.vllm_warns)

    @property
    def why(self) -> str:
        if not self.differs:
            return "same"
        if kv.use_eagle_block_drop(self.method):  # both run: only the trailing-layer rule can part them
            return WHY_TRAILING
        parts = []
        if self.seed_flags != self.vllm_flags:
            parts.append(WHY_FLAGS)
        if self.seed_warns != self.vllm_warns:
            parts.append(WHY_WARNING)
        return "; ".join(parts)


def run_rules(specs, method: str, model_type: str, layout: str, rules: str) -> tuple[list[str], bool]:
    """The flagged groups and whether rule 3 warned, for one run of ``kv_cache_groups``."""
    with kv.captured_warnings() as warned:
        groups = kv.kv_cache_groups(specs, method=method, model_type=model_type, layout=layout, rules=rules)
    return [f"g{i}" for i, g in enumerate(groups) if g.is_eagle_group], bool(warned)


def rule_table(models: dict | None = None, methods=kv.EAGLE_METHODS) -> list[RuleRow]:
    """Every (model, method) run under both rule sets."""
    rows = []
    for label, (build, model_type, layout) in (models or MODELS).items():
        specs = build()
        for method in methods:
            seed = run_rules(specs, method, model_type, layout, "seed")
            vllm = run_rules(specs, method, model_type, layout, "vllm-0.33")
            rows.append(RuleRow(label, method, *seed, *vllm))
    return rows


def format_differences(rows: list[RuleRow]) -> str:
    """The rows where the two rule sets differ, one line each, then why."""
    lines = [f"{'model':26s} {'method':7s} {'seed: flags, warns':22s} {'vllm-0.33: flags, warns':24s}"]
    for r in rows:
        if r.differs:
            lines.append(f"{r.model:26s} {r.method:7s} {str(r.seed_flags or '-') + ', ' + str(r.seed_warns):22s} "
                         f"{str(r.vllm_flags or '-') + ', ' + str(r.vllm_warns):24s}")
    reasons = sorted({r.why for r in rows if r.differs})
    return "\n".join(lines + ["why:"] + [f"  {w}" for w in reasons])
