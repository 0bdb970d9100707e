"""Chapter 5: measured decoding speed — speedups next to tau, and where a step's time goes.

Records are benchmarks/spec_decode.json's "records" ({"method", "block_size", "batch",
"cuda_graphs", "tokens_per_s", "mean_acceptance_length", "device", ...}); phases are its
"phases" ({method: {"block_size", "draft_ms_per_step", "verify_ms_per_step",
"append_ms_per_step", "accept_ms_per_step"}}).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, method_color, titled

METHOD_LABELS = {"dflash": "DFlash", "dflash_poolside": "DFlash (Poolside-style drafter)",
                 "prompt_lookup": "prompt lookup", "prompt_lookup_gpu": "prompt lookup (drafted on the device)",
                 "target_only": "plain greedy"}
# phase key -> (label, colour), in the order a step runs them
PHASE_STYLE = {
    "draft": ("drafter (block forward + lm_head)", PALETTE["blue"]),
    "verify": ("verify (target forward)", PALETTE["grey"]),
    "append": ("context K/V append", PALETTE["green"]),
    "accept": ("sampling (accept + bookkeeping)", PALETTE["orange"]),
}


# batch size -> colour in the speed-up panel (one colour per batch; the x axis names the method)
BATCH_COLORS = (PALETTE["blue"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"], PALETTE["sky"])


def _config_tick(method: str, block: int) -> str:
    """A category label short enough to sit level under its bars: the method's words over the block size."""
    label = METHOD_LABELS.get(method, method).replace(" (Poolside-style drafter)", "<br>(Poolside-style)")
    return f"{label}<br>block {block}"


def speedup_vs_tau_figure(records, *, cuda_graphs: bool = True, prompt_set: str = "heldout",
                          title: str | None = None) -> go.Figure:
    """Per method and block size, two panels with one unit each on one shared axis of methods: on top,
    tau (tokens per target forward, the ceiling of the speedup); below, the measured tokens/s over plain
    greedy decoding, one colour per batch size. One prompt set's records (a record without
    ``prompt_set`` is a held-out one): each speedup is over target-only on the same prompts."""
    from dflash_lab.measure.decoding import PROMPT_SETS, records_of

    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {PROMPT_SETS}, got {prompt_set!r}")
    rows = [r for r in records_of(records, prompt_set) if r["cuda_graphs"] == cuda_graphs]
    if not rows:
        raise ValueError(f"no {prompt_set} records with cuda_graphs={cuda_graphs}")
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["method"] == "target_only"}
    order = list(METHOD_LABELS)
    configs = sorted({(r["method"], r["block_size"]) for r in rows if r["method"] != "target_only"},
                     key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1]))
    xs = [_config_tick(m, b) for m, b in configs]
    by = {(r["method"], r["block_size"], r["batch"]): r for r in rows}
    batch1 = [by.get((m, b, min(base))) for m, b in configs]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=(
        f"τ: tokens per target forward (batch {min(base)}), the ceiling of the speedup",
        "measured speedup: tokens/s over plain greedy decoding, per batch size"))
    fig.add_trace(go.Bar(
        x=xs, y=[r["mean_acceptance_length"] if r else None for r in batch1], name=f"τ (batch {min(base)})",
        marker=dict(color="#d9d9d9", line=dict(color="black", width=0.8)),
        hovertemplate="%{x}: τ %{y:.2f}<extra></extra>"), 1, 1)
    for i, batch in enumerate(sorted(base)):
        ys = [by[(m, b, batch)]["tokens_per_s"] / base[batch] if (m, b, batch) in by else None for m, b in configs]
        fig.add_trace(go.Bar(
            x=xs, y=ys, name=f"speedup, batch {batch}",
            marker=dict(color=BATCH_COLORS[i % len(BATCH_COLORS)], line=dict(color="black", width=0.6)),
            customdata=[[by[(m, b, batch)]["tokens_per_s"], base[batch]] if (m, b, batch) in by else [None, None]
                        for m, b in configs],
            hovertemplate=f"%{{x}}, batch {batch}: %{{y:.2f}}× (%{{customdata[0]:.0f}} vs %{{customdata[1]:.0f}} tok/s)"
                          "<extra></extra>"), 2, 1)
    fig.add_hline(y=1, line=dict(color="black", dash="dash"), row=1, col=1)
    fig.add_hline(y=1, line=dict(color="black", dash="dash"), row=2, col=1)
    fig.update_yaxes(title_text="τ (tokens)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="× plain greedy", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(tickangle=0, automargin=True)
    fig.update_annotations(font_size=12)
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.22))
    graphs = "CUDA graphs on" if cuda_graphs else "CUDA graphs off"
    prompts = {"heldout": "held-out prompts", "docstring": "docstring-first prompts"}[prompt_set]
    return titled(fig, title or f"τ and the measured speedup · {rows[0].get('device', '?')}, {graphs}, {prompts}",
                  height=640)


def has_drafter(method: str) -> bool:
    """True for a method whose step runs a drafter forward (every DFlash drafter); False for plain greedy and
    prompt lookup, whose "draft" phase is only host bookkeeping."""
    return method.startswith("dflash")


def step_time_figure(phases: dict, *, taus: dict | None = None, title: str | None = None) -> go.Figure:
    """One stacked bar per method: milliseconds per step in each phase (each phase timed as its own graph).

    taus: optional {method: tokens per step}; the hover then also gives ms per token.
    """
    if not phases:
        raise ValueError("phases is empty: pass benchmarks/spec_decode.json's 'phases'")
    methods = list(phases)
    ys = [METHOD_LABELS.get(m, m) + (f", block {phases[m]['block_size']}" if m != "target_only" else "")
          for m in methods]
    ms_of = {m: {k: phases[m][f"{k}_ms_per_step"] for k in PHASE_STYLE} for m in methods}
    for m in methods:  # without a drafter the "draft" phase only sets the block's positions: bookkeeping
        if not has_drafter(m):
            ms_of[m]["accept"] += ms_of[m].pop("draft")
            ms_of[m]["draft"] = 0.0
    fig = go.Figure()
    for key, (label, colour) in PHASE_STYLE.items():
        ms = [ms_of[m][key] for m in methods]
        fig.add_trace(go.Bar(y=ys, x=ms, orientation="h", name=label,
                             marker=dict(color=colour, line=dict(color="black", width=0.5)),
                             hovertemplate=f"%{{y}}: {label} %{{x:.3f}} ms per step<extra></extra>"))
    for y, m in zip(ys, methods):
        total = sum(ms_of[m].values())
        tau = (taus or {}).get(m, 1.0 if m == "target_only" else None)
        note = f"{total:.2f} ms/step" + (f" · {total / tau:.2f} ms/token" if tau else "")
        fig.add_annotation(y=y, x=total, text=note, showarrow=False, xanchor="left", xshift=6)
    fig.update_layout(barmode="stack", xaxis_title="ms per step (GPU time, batch 1)",
                      legend=dict(orientation="h", y=-0.35, traceorder="normal"),
                      xaxis=dict(range=[0, 1.35 * max(sum(v.values()) for v in ms_of.values())]))
    fig = titled(fig, title or "Where a step's time goes", height=300)
    fig.update_yaxes(automargin=True)
    return fig
