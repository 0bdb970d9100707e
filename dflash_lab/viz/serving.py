"""Chapter 8: serving a request stream — the straggler effect, static against continuous batching.

Every function takes plain numbers (steps per request, timing records of ``measure.serving``, its
``time_split`` rows) and draws them.
"""

from __future__ import annotations

import plotly.graph_objects as go

from dflash_lab.viz.common import PALETTE, titled

BATCHING_DASH = {"continuous": "solid", "static": "dot"}
VARIANT_DASH = {"scheduled": "dashdot", "chunked": "longdash", "scheduled, chunked": "longdashdot"}  # continuous
COLORS = {"dflash": PALETTE["blue"], "dflash_poolside": PALETTE["green"], "prompt_lookup": PALETTE["orange"],
          "prompt_lookup_gpu": PALETTE["red"]}


def straggler_figure(request_steps, concurrency: int, *, title: str | None = None) -> go.Figure:
    """Each request's own steps (dots) against the steps its static batch ran (bars): a static batch of
    ``concurrency`` consecutive requests runs until its slowest is done."""
    batches = [request_steps[i:i + concurrency] for i in range(0, len(request_steps), concurrency)]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=list(range(1, len(batches) + 1)), y=[max(b) for b in batches], name="steps the batch ran",
                         marker_color=PALETTE["grey"], opacity=0.5))
    xs = [i + 1 for i, b in enumerate(batches) for _ in b]
    fig.add_trace(go.Scatter(x=xs, y=[s for b in batches for s in b], mode="markers", name="steps a request needed",
                             marker=dict(color=COLORS["dflash"], size=7)))
    fig.update_layout(xaxis_title=f"static batch ({concurrency} requests each)", yaxis_title="target steps",
                      legend=dict(orientation="h", y=-0.25), bargap=0.3)
    return titled(fig, title or "The straggler effect: a static batch waits for its slowest request", height=340)


def serving_speedup_figure(records, *, phases: dict | None = None, prompt_set: str = "heldout",
                           methods=tuple(COLORS), title: str | None = None) -> go.Figure:
    """Speed-up over target-only (same concurrency and batching; each method at its best block) against the
    concurrency, continuous (solid) and static (dotted), and where the records hold such runs, served under a
    per-batch schedule (dash-dot), with refills carried by the steps (long dashes) or both; with ``phases``
    ({concurrency: {method: phase row}}), the bound tau x target-only step / drafter step (prefill and ragged
    ends left out) for each drafter."""
    from dflash_lab.measure.serving import run_label  # a record's own reading, above the figures

    rows = [r for r in records if r.get("prompt_set", "heldout") == prompt_set]
    plain = [r for r in rows if run_label(r) == r["method"]]
    base = {(r["batch"], r["batching"]): r["tokens_per_s"] for r in plain if r["method"] == "target_only"}
    fig = go.Figure()
    for method in methods:
        runs = [(b, dash, [r for r in plain if r["batching"] == b]) for b, dash in BATCHING_DASH.items()]
        runs += [(v, dash, [r for r in rows if run_label(r) == f"{r['method']} ({v})"])
                 for v, dash in VARIANT_DASH.items()]
        for label, dash, picked in runs:
            best = {}
            for r in picked:
                if r["method"] == method and (r["batch"], r["batching"]) in base:
                    x = r["tokens_per_s"] / base[r["batch"], r["batching"]]
                    best[r["batch"]] = max(best.get(r["batch"], 0.0), x)
            if label == "static" and 1 in best and (1, "continuous") in base:
                best.pop(1)  # at concurrency 1 the two batchings admit alike: drawn once
            if best:
                cs = sorted(best)
                fig.add_trace(go.Scatter(x=cs, y=[best[c] for c in cs], mode="lines+markers", name=f"{method}, {label}",
                                         line=dict(color=_color(method), dash=dash)))
        bound = _bound(plain, phases or {}, method)
        if bound:
            cs = sorted(bound)
            fig.add_trace(go.Scatter(x=cs, y=[bound[c] for c in cs], mode="markers", name=f"{method}: step bound",
                                     marker=dict(color=_color(method), symbol="line-ew-open", size=16)))
    fig.add_hline(y=1, line=dict(color="black", dash="dash"))
    fig.update_xaxes(type="log", title_text="concurrency (requests at once)", tickvals=sorted({c for c, _ in base}))
    fig.update_yaxes(title_text="× target-only", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.3))
    return titled(fig, title or f"Speed-up against concurrency ({prompt_set} prompts)", height=420)


def _bound(rows, phases: dict, method: str) -> dict:
    """{concurrency: tau x target-only whole step / the method's whole step} where the phases hold both."""
    out = {}
    for c, per in phases.items():
        if method not in per or "target_only" not in per:
            continue
        taus = [r["mean_acceptance_length"] for r in rows if r["method"] == method and r["batch"] == int(c)
                and r["block_size"] == per[method]["block_size"] and r["batching"] == "continuous"]
        if taus:
            out[int(c)] = taus[0] * per["target_only"]["whole_step_ms"] / per[method]["whole_step_ms"]
    return out


def _color(method: str) -> str:
    return COLORS.get(method, PALETTE["purple"])


def serving_time_figure(rows, *, title: str | None = None) -> go.Figure:
    """``measure.serving.time_split`` rows: each run's seconds stacked as time in batch steps (solid) and time
    outside them (hatched), one bar per method, grouped by concurrency (each bar relative to its run)."""
    fig = go.Figure()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        x = [f"c = {r['batch']}" for r in mine]
        color = COLORS.get(method, PALETTE["grey"])
        for part, pattern in (("in_steps_s", ""), ("outside_s", "/")):
            fig.add_trace(go.Bar(x=x, y=[100 * r[part] / r["seconds"] for r in mine], offsetgroup=method,
                                 name=f"{method}: {'in batch steps' if part == 'in_steps_s' else 'outside them'}",
                                 marker=dict(color=color, pattern_shape=pattern),
                                 customdata=[[r["seconds"], r["occupancy"]] for r in mine],
                                 hovertemplate="%{y:.0f} % of %{customdata[0]:.3f} s; rows busy "
                                               "%{customdata[1]:.0%}<extra></extra>"))
    fig.update_layout(barmode="relative", yaxis_title="% of the run's wall time", xaxis_title="concurrency",
                      legend=dict(orientation="h", y=-0.3))
    return titled(fig, title or "Where a served run's time goes", height=380)
