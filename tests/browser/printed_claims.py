"""What no chapter may print: a τ without its setting, a raw ``nan``, a markdown pipe table as plain text.

``printed_problems(outputs)`` takes each code cell's outputs as nbformat JSON (the committed notebook's, or
JupyterLab's after Run All) and returns one line per problem. Printed text is what a cell writes to
stdout/stderr and the text/plain of its results; rendered Markdown (``viz.answer_table``) is not printed text.

A τ has its setting when the same cell's printed text names the prompts, the new-token budget and the block
(the words "prompt", "token" and "block"), so a reader can tell why it differs from the headline τ.
"""

from __future__ import annotations

import re

TAU = re.compile(r"(?:τ|\btau\b)\s*(?:=\s*)?[-+]?\d+\.\d+")
SETTING_WORDS = ("prompt", "token", "block")
NAN = re.compile(r"\b(?:nan|NaN)\b")
PIPE_ROW = re.compile(r"^\s*\|.*\|\s*$")
PIPE_RULE = re.compile(r"^\s*\|(?:\s*:?-{3,}:?\s*\|)+\s*$")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def printed_text(outputs) -> str:
    """A cell's printed text: its streams and the text/plain of its results (not HTML, Markdown or figures)."""
    parts = []
    for o in outputs:
        if o.get("output_type") == "stream":
            parts.append(_text(o.get("text")))
        elif o.get("output_type") in ("execute_result", "display_data"):
            data = o.get("data", {})
            if not any(k.startswith(("text/markdown", "text/html", "application/")) for k in data):
                parts.append(_text(data.get("text/plain")))
    return "".join(parts)


def problems_in(text: str) -> list[str]:
    """The problems in one cell's printed text."""
    out = []
    lines = text.splitlines()
    for line in lines:
        if NAN.search(line):
            out.append(f"a raw nan: {line.strip()[:120]}")
    if any(PIPE_RULE.match(b) and PIPE_ROW.match(a) for a, b in zip(lines, lines[1:])):
        out.append("a markdown pipe table printed as text (display it with viz.answer_table or Markdown)")
    if TAU.search(text):
        missing = [w for w in SETTING_WORDS if w not in text.lower()]
        if missing:
            line = next(x for x in lines if TAU.search(x))
            out.append(f"a τ without its setting (no {', '.join(repr(m) for m in missing)}): {line.strip()[:120]}")
    return out


def printed_problems(cell_outputs) -> list[str]:
    """cell_outputs: a list (one entry per code cell) of that cell's outputs as nbformat JSON."""
    return [f"code cell {i + 1}: {p}" for i, outputs in enumerate(cell_outputs)
            for p in problems_in(printed_text(outputs))]
