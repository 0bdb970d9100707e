"""Chapter 5: the speed model's predictions beside the published and the measured speed-ups.

Rows are ``measure.speed_model.poolside_table`` ({"card", "quantization", "benchmark",
"concurrency", "published", "predicted_measured", "predicted_floor", ...}) and
``lab_pair_table`` ({"batch", "block", "measured", "predicted", ...}). One point per row:
x = the known speed-up, y = the prediction; on the y = x line the model is right.
"""

from __future__ import annotations

import plotly.graph_objects as go

from dflash_lab.viz.common import PALETTE, titled

CARD_COLORS = {"BF16": PALETTE["blue"], "INT4": PALETTE["orange"], "FP8": PALETTE["green"],
               "NVFP4": PALETTE["purple"], "shipped pair": PALETTE["grey"]}


def predicted_vs_published_figure(poolside_rows, lab_rows=(), *, costs: str = "measured",
                                  title: str | None = None) -> go.Figure:
    """Predicted speed-up (y) against the published or measured one (x), with the y = x line.

    costs: "measured" (the lab's graphed XS.2 steps) or "floor" (their bytes floors) for the card rows.
    """
    key = f"predicted_{costs}"
    fig = go.Figure()
    groups: dict = {}
    for r in poolside_rows:
        c = "c=?" if r["concurrency"] is None else f"c={r['concurrency']}"
        groups.setdefault((r["quantization"], c), []).append(r)
    for (quant, c), rows in groups.items():
        fig.add_trace(go.Scatter(
            x=[r["published"] for r in rows], y=[r[key] for r in rows], mode="markers",
            name=f"{rows[0]['card'].split('/')[-1]} {c}",
            marker=dict(color=CARD_COLORS.get(quant, PALETTE["grey"]), size=9,
                        symbol="circle" if c in ("c=1", "c=?") else "diamond-open"),
            text=[f"{r['benchmark']}: tau {r['tau']}, published {r['published']}x, predicted {r[key]}x "
                  f"({r['costs_from']})" for r in rows], hoverinfo="text"))
    if lab_rows:
        fig.add_trace(go.Scatter(
            x=[r["measured"] for r in lab_rows], y=[r["predicted"] for r in lab_rows], mode="markers",
            name="the lab's shipped pair (measured)", marker=dict(color=CARD_COLORS["shipped pair"], size=9,
                                                                  symbol="square"),
            text=[f"batch {r['batch']}, block {r['block']}: tau {r['tau']:.2f}, measured {r['measured']}x, "
                  f"predicted {r['predicted']}x" for r in lab_rows], hoverinfo="text"))
    values = [v for tr in fig.data for v in (*tr.x, *tr.y)] or [1.0, 4.0]
    lo, hi = 0.9 * min(values), 1.05 * max(values)
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x (prediction right)",
                             line=dict(color="black", dash="dash", width=1)))
    fig.update_layout(xaxis_title="published (cards) or measured (lab pair) speed-up",
                      yaxis_title="predicted: τ × T_target(1) / (T_target(B) + T_drafter(B))",
                      template="plotly_white", legend=dict(font=dict(size=10)))
    return titled(fig, title or f"Predicted vs known DFlash speed-up (card rows from the {costs} Laguna-XS.2 "
                  "step costs; the lab's pair from its own measured steps)", height=560)
