"""Chapter 2: the drafter's context K/V, its norms, and how far each path is from the reference."""

from __future__ import annotations

import plotly.graph_objects as go

from dflash_lab.viz.common import _array, _positions_axis, _side_by_side

# K and V arrive as (L, N, nkv, hd) tensors (precompute_context_kv's layout);
# "norm" is the L2 norm over the channels that are left after the chosen axes.


def _norm_maps(left, right, *, rows, positions, titles, title: str, what: str = "norm",
               colorscales=("Viridis", "Cividis")) -> go.Figure:
    """Two (rows, N) arrays of norms as heatmaps over context positions."""
    xs = _positions_axis(positions, left.shape[1])
    hover = f"%{{y}}, position %{{x}}<br>{what} %{{z:.3f}}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=left, x=xs, y=rows, colorscale=colorscales[0], hovertemplate=hover),
        go.Heatmap(z=right, x=xs, y=rows, colorscale=colorscales[1], hovertemplate=hover),
        titles, title=title, height=180 + 28 * len(rows),
    )


def context_kv_norms_figure(k, v, *, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per drafter layer × context position (norm over every head and channel)."""
    kn, vn = (((_array(a) ** 2).sum(axis=(2, 3))) ** 0.5 for a in (k, v))  # (L, N) from (L, N, nkv, hd)
    return _norm_maps(kn, vn, rows=[f"layer {l}" for l in range(len(kn))], positions=positions,
                      titles=("‖K‖ (after K-norm and RoPE)", "‖V‖ (as projected)"),
                      title=title or "Context K/V norms per layer and position")


def context_kv_head_norms_figure(k, v, *, layer: int = 0, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per KV head × context position, for one drafter layer."""
    kn, vn = ((((_array(a)[layer] ** 2).sum(axis=-1)) ** 0.5).T for a in (k, v))  # (nkv, N)
    return _norm_maps(kn, vn, rows=[f"kv head {h}" for h in range(len(kn))], positions=positions,
                      titles=(f"‖K‖ per head, layer {layer}", f"‖V‖ per head, layer {layer}"),
                      title=title or f"Context K/V norms per KV head and position (layer {layer})")


def k_norm_effect_figure(k_before, k_after, *, positions=None, title: str | None = None) -> go.Figure:
    """Per-head ‖K‖ before and after K-norm, averaged over heads, per layer × position.

    Before: the raw projection, whose size follows the context state. After:
    every head vector has unit RMS times the K-norm weight (RoPE keeps norms), so
    each layer's row becomes flat.
    """
    b, a = ((((_array(x) ** 2).sum(axis=-1)) ** 0.5).mean(axis=-1) for x in (k_before, k_after))  # (L, N)
    return _norm_maps(b, a, rows=[f"layer {l}" for l in range(len(b))], positions=positions,
                      titles=("before K-norm (raw projection)", "after K-norm and RoPE"),
                      title=title or "What K-norm does: per-head ‖K‖ before and after",
                      what="mean per-head norm", colorscales=("Magma", "Viridis"))


def context_kv_path_figure(k, v, k_ref, v_ref, *, path: str, positions=None, title: str | None = None) -> go.Figure:
    """One path's ‖K‖ next to its largest |K - K_reference| per layer × position."""
    k, v, k_ref, v_ref = (_array(x) for x in (k, v, k_ref, v_ref))
    L, N = k.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"layer {l}" for l in range(L)]
    dk, dv = abs(k - k_ref), abs(v - v_ref)
    err = dk.max(axis=(2, 3))  # (L, N)
    heading = title or (f"path = {path}: max |ΔK| = {dk.max():.2e}, max |ΔV| = {dv.max():.2e} "
                        f"(mean {dk.mean():.1e} / {dv.mean():.1e}) against the reference")
    return _side_by_side(
        go.Heatmap(z=((k**2).sum(axis=(2, 3))) ** 0.5, x=xs, y=ys, colorscale="Viridis",
                   hovertemplate="%{y}, position %{x}<br>‖K‖ %{z:.4f}<extra></extra>"),
        go.Heatmap(z=err, x=xs, y=ys, colorscale="Reds", zmin=0, zmax=max(float(err.max()), 1e-12),
                   hovertemplate="%{y}, position %{x}<br>max |ΔK| %{z:.2e}<extra></extra>"),
        (f"‖K‖, {path} path", f"max |K_{path} − K_reference|"),
        title=heading, height=190 + 28 * L,
    )
