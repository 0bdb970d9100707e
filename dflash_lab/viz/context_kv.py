"""Chapter 2: the drafter's context K/V, its norms, and how far each path is from the reference."""

from __future__ import annotations

import plotly.graph_objects as go

from dflash_lab.viz.common import _array, _positions_axis, _side_by_side

# K and V arrive as (L, N, nkv, hd) tensors (precompute_context_kv's layout);
# "norm" is the L2 norm over the channels that are left after the chosen axes.


def _hover_tokens(tokens, n: int):
    """Per position, the token text for hover (escaped plotly-safe), or None."""
    if tokens is None:
        return None
    texts = [str(t).replace("<", "‹").replace(">", "›").replace("\n", "↵") for t in tokens]
    if len(texts) != n:
        raise ValueError(f"tokens has {len(texts)} entries for {n} context positions")
    return texts


def _norm_maps(left, right, *, rows, positions, titles, title: str, what: str = "norm",
               colorscales=("Viridis", "Cividis"), tokens=None, colorbar_titles=(None, None),
               shared_scale: bool = False) -> go.Figure:
    """Two (rows, N) arrays of norms as heatmaps over context positions; ``tokens`` label positions in hover."""
    xs = _positions_axis(positions, left.shape[1])
    texts = _hover_tokens(tokens, left.shape[1])
    custom = None if texts is None else [texts] * len(rows)
    token = "" if texts is None else " %{customdata!r}"
    hover = f"%{{y}}, position %{{x}}{token}<br>{what} %{{z:.3f}}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=left, x=xs, y=rows, colorscale=colorscales[0], customdata=custom, hovertemplate=hover),
        go.Heatmap(z=right, x=xs, y=rows, colorscale=colorscales[1], customdata=custom, hovertemplate=hover),
        titles, title=title, height=200 + 28 * len(rows), colorbar_titles=colorbar_titles, shared_scale=shared_scale,
    )


def context_kv_norms_figure(k, v, *, positions=None, title: str | None = None, tokens=None) -> go.Figure:
    """‖K‖ and ‖V‖ per drafter layer × context position (norm over every head and channel)."""
    kn, vn = (((_array(a) ** 2).sum(axis=(2, 3))) ** 0.5 for a in (k, v))  # (L, N) from (L, N, nkv, hd)
    return _norm_maps(kn, vn, rows=[f"layer {l}" for l in range(len(kn))], positions=positions,
                      titles=("‖K‖ (after K-norm and RoPE)", "‖V‖ (as projected)"),
                      title=title or "Context K/V norms per layer and position", tokens=tokens,
                      colorbar_titles=("‖K‖, L2 over heads×channels (no unit)",
                                       "‖V‖, L2 over heads×channels (no unit)"))


def context_kv_head_norms_figure(k, v, *, layer: int = 0, positions=None, title: str | None = None,
                                 tokens=None) -> go.Figure:
    """‖K‖ and ‖V‖ per KV head × context position, for one drafter layer."""
    kn, vn = ((((_array(a)[layer] ** 2).sum(axis=-1)) ** 0.5).T for a in (k, v))  # (nkv, N)
    return _norm_maps(kn, vn, rows=[f"kv head {h}" for h in range(len(kn))], positions=positions,
                      titles=(f"‖K‖ per head, layer {layer}", f"‖V‖ per head, layer {layer}"),
                      title=title or f"Context K/V norms per KV head and position (layer {layer})", tokens=tokens,
                      colorbar_titles=("‖K‖ per head, L2 (no unit)", "‖V‖ per head, L2 (no unit)"))


def _row_spread(x) -> float:
    """Mean over rows of (max - min) / mean along the row: 0 for perfectly flat rows."""
    a = _array(x)
    return float(((a.max(axis=1) - a.min(axis=1)) / a.mean(axis=1)).mean())


def k_norm_effect_figure(k_before, k_after, *, positions=None, title: str | None = None, tokens=None) -> go.Figure:
    """Per-head ‖K‖ before and after K-norm, averaged over heads, per layer × position, on ONE colour scale.

    Before: the raw projection, whose size follows the context state. After:
    every head vector has unit RMS times the K-norm weight (RoPE keeps norms), so
    each layer's row becomes flat. The subplot titles give each side's row spread
    ((max − min) / mean along a row, averaged over layers): near 0 is flat.
    """
    b, a = ((((_array(x) ** 2).sum(axis=-1)) ** 0.5).mean(axis=-1) for x in (k_before, k_after))  # (L, N)
    return _norm_maps(b, a, rows=[f"layer {l}" for l in range(len(b))], positions=positions,
                      titles=(f"before K-norm (raw projection): row spread {_row_spread(b):.2f}",
                              f"after K-norm and RoPE: row spread {_row_spread(a):.2f}"),
                      title=title or "What K-norm does: per-head ‖K‖ before and after, one colour scale",
                      what="mean per-head norm", colorscales=("Viridis", "Viridis"), tokens=tokens,
                      colorbar_titles=(None, "mean per-head ‖K‖, L2 (no unit)"), shared_scale=True)


def context_kv_path_figure(k, v, k_ref, v_ref, *, path: str, positions=None, title: str | None = None,
                           tokens=None) -> go.Figure:
    """One path's ‖K‖ next to its largest |K - K_reference| per layer × position."""
    k, v, k_ref, v_ref = (_array(x) for x in (k, v, k_ref, v_ref))
    L, N = k.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"layer {l}" for l in range(L)]
    dk, dv = abs(k - k_ref), abs(v - v_ref)
    err = dk.max(axis=(2, 3))  # (L, N)
    heading = title or (f"path = {path}: max |ΔK| = {dk.max():.2e}, max |ΔV| = {dv.max():.2e} "
                        f"(mean {dk.mean():.1e} / {dv.mean():.1e}) against the reference")
    texts = _hover_tokens(tokens, N)
    custom, token = (None, "") if texts is None else ([texts] * L, " %{customdata!r}")
    return _side_by_side(
        go.Heatmap(z=((k**2).sum(axis=(2, 3))) ** 0.5, x=xs, y=ys, colorscale="Viridis", customdata=custom,
                   hovertemplate="%{y}, position %{x}" + token + "<br>‖K‖ %{z:.4f}<extra></extra>"),
        go.Heatmap(z=err, x=xs, y=ys, colorscale="Reds", zmin=0, zmax=max(float(err.max()), 1e-12), customdata=custom,
                   hovertemplate="%{y}, position %{x}" + token + "<br>max |ΔK| %{z:.2e}<extra></extra>"),
        (f"‖K‖, {path} path", f"max |K_{path} − K_reference|"),
        title=heading, height=210 + 28 * L,
        colorbar_titles=("‖K‖, L2 (no unit)", "max |ΔK| over heads×channels"),
    )
