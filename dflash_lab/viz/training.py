"""Training logs: the training_log.json that `python -m dflash_lab.train target|drafter`
writes next to its checkpoint (a dict, or the path of the file or its folder)."""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, titled


def read_training_log(log) -> dict:
    """A training log as a dict, from a dict, a training_log.json path or a checkpoint folder."""
    if isinstance(log, dict):
        return log
    path = Path(log)
    if path.is_dir():
        path = path / "training_log.json"
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    return json.loads(path.read_text())


def _acceptance_results(log: dict) -> list[dict]:
    """The held-out acceptance results in a drafter log, largest block first."""
    evs = [ev for ev in (log.get("final") or {}).values() if isinstance(ev, dict) and "mean_acceptance_length" in ev]
    return sorted(evs, key=lambda ev: -ev["block_size"])


def _training_summary(log: dict) -> str:
    where = log.get("device_name") or log.get("device", "?")
    parts = [f"{log.get('steps', '?')} steps", f"{log.get('train_seconds', 0):.0f} s on {where}"]
    final = log.get("final") or {}
    if log.get("stage") == "target" and "heldout_loss" in final:
        parts.append(f"held-out loss {final['heldout_loss']:.3f} (ppl {final['heldout_perplexity']:.1f})")
    for ev in _acceptance_results(log):
        parts.append(f"τ {ev['mean_acceptance_length']:.2f} at block {ev['block_size']}")
    return ", ".join(parts)


def plot_training_log(log, *, title: str | None = None) -> go.Figure:
    """Loss curve (and held-out loss) of a target log; loss + per-position agreement of a drafter log."""
    log = read_training_log(log)
    stage = log.get("stage", "?")
    curve = log.get("loss_curve") or []
    steps, losses = [c[0] for c in curve], [c[1] for c in curve]
    is_drafter = stage == "drafter"
    fig = make_subplots(rows=1, cols=2 if is_drafter else 1, horizontal_spacing=0.12,
                        subplot_titles=("training loss", "per block position") if is_drafter else None)
    fig.add_trace(go.Scatter(x=steps, y=losses, mode="lines", name="train loss", line=dict(color=PALETTE["blue"]),
                             hovertemplate="step %{x}: %{y:.3f}<extra>train</extra>"), 1, 1)
    evals = log.get("eval_curve") or []
    if evals:
        fig.add_trace(go.Scatter(x=[e[0] for e in evals], y=[e[1] for e in evals], mode="lines+markers",
                                 name="held-out loss", line=dict(color=PALETTE["orange"]),
                                 hovertemplate="step %{x}: %{y:.3f}<extra>held-out</extra>"), 1, 1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="cross-entropy (nats)", row=1, col=1)
    if is_drafter:
        acc = log.get("accuracy_curve") or []
        if acc:
            last = acc[-1][1]
            fig.add_trace(go.Bar(x=list(range(1, len(last) + 1)), y=last, name="train: top-1 agrees with target",
                                 marker_color=PALETTE["sky"],
                                 hovertemplate="position %{x}: %{y:.2f}<extra>train agreement</extra>"), 1, 2)
        colours = [PALETTE["red"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"]]
        for ev, colour in zip(_acceptance_results(log), colours):
            rates = ev["per_position_acceptance_rate"]
            fig.add_trace(go.Scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers",
                                     name=f"held-out acceptance (block {ev['block_size']})", line=dict(color=colour),
                                     hovertemplate="position %{x}: %{y:.2f}<extra>held-out</extra>"), 1, 2)
        fig.update_xaxes(title_text="block position j", row=1, col=2)
        fig.update_yaxes(title_text="rate", range=[0, 1], row=1, col=2)
    fig.update_layout(legend=dict(orientation="h", y=-0.25))
    return titled(fig, title or f"{stage} training: {_training_summary(log)}", height=400, width_chars=100)
