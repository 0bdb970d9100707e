"""Controls for the lab: ipywidgets wired to the figure functions in viz.py.

Widgets hold no logic of their own: each control re-runs a package function
and hands the result to a viz function. One section per chapter.
"""

from __future__ import annotations

import ipywidgets as widgets


# ---------------------------------------------------------------------------
# Chapter 1-2: the drafter and its context K/V
# ---------------------------------------------------------------------------

CONTEXT_KV_DTYPES = ("float32", "bfloat16")


def _redraw_figure_widget(fig_widget, fig) -> None:
    """Put ``fig``'s traces and layout into an existing FigureWidget (same trace count)."""
    with fig_widget.batch_update():
        for old, new in zip(fig_widget.data, fig.data):
            old.update(new.to_plotly_json(), overwrite=True)
        fig_widget.layout.update(fig.layout.to_plotly_json(), overwrite=True)


def drafter_config_explorer(config: dict) -> widgets.VBox:
    """Change a drafter config's depth, layer types and gate; see vLLM's verdict and the tensors.

    Each change runs ``DFlashDrafterConfig.from_dict`` on the edited dict. A
    config vLLM would refuse shows its error; a valid one builds the drafter on
    the meta device (no memory) and redraws ``viz.parameter_table_figure``. The
    returned box exposes ``.layers``, ``.layer_types``, ``.gating``, ``.figure``
    and ``.status``.
    """
    import copy
    import html

    import plotly.graph_objects as go
    import torch

    from dflash_lab import viz
    from dflash_lab.config import DFlashDrafterConfig
    from dflash_lab.drafter import DFlashLagunaDrafter

    layers = widgets.IntSlider(value=config["num_hidden_layers"], min=1, max=6, description="layers")
    layer_types = widgets.Dropdown(description="layer types", value="full_attention", options=[
        ("all full_attention", "full_attention"), ("all sliding_attention", "sliding_attention"),
        ("mixed (vLLM refuses)", "mixed")])
    gating = widgets.Dropdown(description="gate", value=True, options=[
        ("one per head (True)", True), ("one per channel (per-element)", "per-element"), ("none (False)", False)])
    status = widgets.HTML()

    def edited() -> dict:
        d = copy.deepcopy(config)
        n = d["num_hidden_layers"] = layers.value
        kinds = ["full_attention", "sliding_attention"]
        d["layer_types"] = [kinds[j % 2] for j in range(n)] if layer_types.value == "mixed" else [layer_types.value] * n
        d["gating"] = gating.value
        if layer_types.value != "full_attention":
            d.setdefault("sliding_window", 64)
        return d

    def figure():
        try:
            cfg = DFlashDrafterConfig.from_dict(edited())
        except (ValueError, NotImplementedError) as exc:
            status.value = f"<b>refused</b>: {type(exc).__name__}: {html.escape(str(exc))}"
            return None
        with torch.device("meta"):  # shapes only, no memory
            drafter = DFlashLagunaDrafter(cfg)
        rows = [(name, tuple(t.shape), t.numel()) for name, t in drafter.state_dict().items()]
        names = drafter.attention_layer_names()
        status.value = (f"<b>valid</b>: RoPE on {cfg.rotary_dim} of {cfg.head_dim} channels, window {cfg.window}; "
                        f"attention layers {names[0]} … {names[-1]}")
        return viz.parameter_table_figure(
            rows, title=f"{cfg.num_hidden_layers} × {cfg.layer_type}, gating={cfg.gating!r}: "
                        f"{sum(r[2] for r in rows):,} parameters")

    fig = go.FigureWidget(figure())

    def redraw(*_):
        new = figure()
        if new is not None:  # a refused config leaves the last valid picture
            _redraw_figure_widget(fig, new)

    for control in (layers, layer_types, gating):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([layers, layer_types, gating]), status, fig])
    box.layers, box.layer_types, box.gating, box.figure, box.status = layers, layer_types, gating, fig, status
    return box


def context_kv_path_explorer(drafter, context, positions) -> widgets.VBox:
    """Switch among the three context-K/V paths (and float32/bfloat16); see that they agree.

    Each change re-runs ``drafter.precompute_context_kv`` with the chosen path
    and dtype, redraws ``viz.context_kv_path_figure`` against the reference path
    in the same dtype, and reports the largest error against the issue's
    tolerance. The returned box exposes ``.path``, ``.dtype``, ``.figure`` and
    ``.agreement`` for scripted use.
    """
    import copy
    import time

    import plotly.graph_objects as go
    import torch

    from dflash_lab import viz
    from dflash_lab.drafter import CONTEXT_KV_PATHS, context_kv_agreement

    path = widgets.Dropdown(options=list(CONTEXT_KV_PATHS), value="reference", description="path")
    dtype = widgets.Dropdown(options=list(CONTEXT_KV_DTYPES), value="float32", description="dtype")
    agreement = widgets.HTML()
    copies = {}  # one drafter copy per dtype, made on first use

    def compute(path_name, dtype_name):
        dt = getattr(torch, dtype_name)
        if dtype_name not in copies:
            copies[dtype_name] = drafter if next(drafter.parameters()).dtype == dt else copy.deepcopy(drafter).to(dt)
        model, ctx = copies[dtype_name], context.to(dt)
        with torch.no_grad():
            ref = model.precompute_context_kv(ctx, positions, path="reference")
            start = time.perf_counter()
            out = model.precompute_context_kv(ctx, positions, path=path_name)
            ms = 1e3 * (time.perf_counter() - start)
        return out, ref, ms

    def figure(path_name, dtype_name):
        (k, v), (k_ref, v_ref), ms = compute(path_name, dtype_name)
        agree = context_kv_agreement((k, v), (k_ref, v_ref))
        errors, ok, max_tol, mean_tol = agree["errors"], agree["ok"], agree["max_tol"], agree["mean_tol"]
        rule = f"max ≤ {max_tol:.3g}" + (f", mean ≤ {mean_tol:g}" if mean_tol else "")
        agreement.value = (
            f"<b>{path_name}</b> in {dtype_name}: max |ΔK| = {errors[0].max():.2e}, max |ΔV| = {errors[1].max():.2e} "
            f"(tolerance {rule}) → {'<b>agree</b> ✓' if ok else '<b>DISAGREE</b> ✗'} · {ms:.1f} ms"
        )
        return viz.context_kv_path_figure(k, v, k_ref, v_ref, path=f"{path_name} ({dtype_name})", positions=positions)

    fig = go.FigureWidget(figure(path.value, dtype.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(path.value, dtype.value))

    path.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([path, dtype]), agreement, fig])
    box.path, box.dtype, box.figure, box.agreement = path, dtype, fig, agreement
    return box


def sliding_window_explorer(*, context_len: int = 24, block_size: int = 8, window: int = 8) -> widgets.VBox:
    """Toggle the sliding window and change its size; see which keys each block query sees.

    The block starts right after ``context_len`` context positions. Each change
    recomputes ``drafter.dflash_attention_mask`` (full attention when the
    window is off) and redraws ``viz.visibility_mask_figure``. The returned box
    exposes ``.sliding``, ``.window``, ``.figure`` and ``.summary``.
    """
    import plotly.graph_objects as go
    import torch

    from dflash_lab import viz
    from dflash_lab.drafter import dflash_attention_mask

    sliding = widgets.Checkbox(value=True, description="sliding window")
    size = widgets.IntSlider(value=window, min=1, max=context_len + block_size, description="window")
    summary = widgets.HTML()
    ctx_pos = torch.arange(context_len)
    q_pos = torch.arange(context_len, context_len + block_size)

    def figure(on: bool, w: int):
        mask = dflash_attention_mask(q_pos[None], ctx_pos, block_size, w if on else None)[0]  # (Q, N+Q)
        seen = mask[:, :context_len].sum(-1).tolist()
        summary.value = ("context keys seen per block query: " + ", ".join(map(str, seen))
                         + (f" (window {w})" if on else " (full attention)"))
        label = f"sliding window {w}" if on else "full attention (no window)"
        return viz.visibility_mask_figure(mask, query_positions=q_pos, key_positions=torch.cat([ctx_pos, q_pos]),
                                          context_len=context_len, title=f"Which keys each block query sees: {label}")

    fig = go.FigureWidget(figure(sliding.value, size.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(sliding.value, size.value))

    def resize(_):
        if sliding.value:
            redraw()
        else:
            sliding.value = True  # moving the window switches it on (the checkbox observer redraws)

    sliding.observe(redraw, names="value")
    size.observe(resize, names="value")
    box = widgets.VBox([widgets.HBox([sliding, size]), summary, fig])
    box.sliding, box.window, box.figure, box.summary = sliding, size, fig, summary
    return box


# ---------------------------------------------------------------------------
# Chapter 3: per-position acceptance
# ---------------------------------------------------------------------------


def acceptance_explorer(target, drafter, prompt_sets: dict, *, tokenizer=None, max_new_tokens: int = 32,
                        temperatures=(0.0, 0.25, 0.5, 0.75, 1.0), block_size: int = 8, seed: int = 0) -> widgets.VBox:
    """Pick the block size, temperature, prompt set and drafter; watch acceptance change.

    ``prompt_sets`` maps a name to a list of prompts (token-id lists or tensors).
    Each new combination runs ``spec_decode.generate_on_prompts`` once (results
    are kept, so going back is instant) and redraws
    ``viz.per_position_acceptance_figure`` and ``viz.acceptance_length_histogram``;
    with a ``tokenizer``, the first prompt's output is shown with
    ``viz.acceptance_tokens_html``. The returned box exposes ``.block_size``,
    ``.temperature``, ``.prompt_set``, ``.method``, ``.figures``, ``.summary``,
    ``.tokens`` and ``.results`` (the cache, keyed by those four settings).
    """
    import plotly.graph_objects as go

    from dflash_lab import viz
    from dflash_lab.spec_decode import generate_on_prompts

    largest = drafter.config.block_size
    block = widgets.IntSlider(value=min(block_size, largest), min=2, max=largest, description="block size",
                              continuous_update=False)
    temperature = widgets.SelectionSlider(options=list(temperatures), value=temperatures[0], description="temperature",
                                          continuous_update=False)
    prompt_set = widgets.Dropdown(options=list(prompt_sets), description="prompts")
    method = widgets.ToggleButtons(options=["DFlash", "prompt lookup"], description="drafter")
    summary, tokens = widgets.HTML(), widgets.HTML()
    results = {}

    def run():
        key = (method.value, block.value, temperature.value, prompt_set.value)
        if key not in results:
            summary.value = "<i>generating…</i>"
            results[key] = generate_on_prompts(
                target, drafter if method.value == "DFlash" else "ngram", prompt_sets[prompt_set.value],
                max_new_tokens=max_new_tokens, block_size=block.value, temperature=temperature.value, seed=seed,
                progress=False)
        return results[key]

    def describe(stats, outputs):
        tau = f"<b>{stats.mean_acceptance_length:.2f}</b> over {stats.num_drafts} drafts" if stats.num_drafts else "— (no drafts)"
        summary.value = (
            f"<b>{method.value}</b>, block {block.value}, temperature {temperature.value}, "
            f"{len(outputs)} prompts × {max_new_tokens} tokens: mean acceptance length {tau} · "
            f"{stats.target_forwards_per_token:.2f} target forwards per token")
        if tokenizer is not None and outputs:
            tokens.value = viz.acceptance_tokens_html(outputs[0], tokenizer)

    stats, outputs = run()
    per_position = go.FigureWidget(viz.per_position_acceptance_figure(stats))
    lengths = go.FigureWidget(viz.acceptance_length_histogram(stats))
    describe(stats, outputs)

    def redraw(*_):
        stats, outputs = run()
        _redraw_figure_widget(per_position, viz.per_position_acceptance_figure(stats))
        _redraw_figure_widget(lengths, viz.acceptance_length_histogram(stats))
        describe(stats, outputs)

    for control in (block, temperature, prompt_set, method):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([block, temperature]), widgets.HBox([prompt_set, method]), summary,
                        per_position, lengths, tokens])
    box.block_size, box.temperature, box.prompt_set, box.method = block, temperature, prompt_set, method
    box.figures, box.summary, box.tokens, box.results = (per_position, lengths), summary, tokens, results
    return box


# ---------------------------------------------------------------------------
# Chapter 4: hybrid KV-cache groups
# ---------------------------------------------------------------------------


def kv_groups_explorer(*, kv_budget_bytes: int = 1 << 30) -> widgets.VBox:
    """Pick a model, a drafter method and a cache layout; see vLLM's groups and the flagged one.

    Every change re-runs ``kv_groups.kv_cache_groups`` (vLLM's grouping + the draft-group
    rules) and redraws, in place, the layout diagram and the memory figure for
    ``kv_budget_bytes``.
    """
    import plotly.graph_objects as go

    from dflash_lab import kv_groups as kv
    from dflash_lab import viz

    preset = widgets.Dropdown(options=[(p["label"], name) for name, p in kv.PRESETS.items()], description="model")
    method = widgets.Dropdown(options=[*((m, m) for m in kv.EAGLE_METHODS), ("none (no drafter)", None)], description="method")
    sliding = widgets.Checkbox(description="drafter sliding window", value=False)
    layout = widgets.Dropdown(options=[("general (LBHNC)", "LBHNC"), ("packed (BLHNC)", "BLHNC")], description="layout")
    hybrid_off = widgets.Checkbox(description="hybrid manager disabled", value=False)
    layout_fig, memory_fig = go.FigureWidget(), go.FigureWidget()

    def show(widget, fig):
        with widget.batch_update():
            widget.data = ()
            widget.add_traces(fig.data)
            widget.layout = fig.layout
            widget.layout.width = 1000  # a widget's figure does not stretch to the page by itself

    def redraw(*_):
        p = kv.PRESETS[preset.value]
        specs = kv.preset_specs(preset.value, drafter_sliding=sliding.value)
        title = f"{p['label']} · method={method.value} · {layout.value} ({kv.LAYOUTS.get(layout.value)})"
        if preset.value == "laguna_dflash":  # only the DFlash drafter has its own layer_types
            window = "sliding" if sliding.value else "full"
            title += f"<br>drafter layers: {window} attention; their KV cache: full attention either way"
        else:
            title += f"<br>drafter sliding window {'on' if sliding.value else 'off'}: no effect, an MTP block reuses a target layer"
        run = dict(method=method.value, model_type=p["model_type"], layout=layout.value)
        with kv.captured_warnings() as warned:
            try:
                groups = kv.kv_cache_groups(specs, **run, hybrid_manager_disabled=hybrid_off.value)
            except ValueError:  # vLLM 0.33 cannot disable the hybrid manager for every model
                title += "<br>✗ vLLM 0.33 cannot disable the hybrid manager for this model: shown enabled"
                groups = kv.kv_cache_groups(specs, **run)
        show(layout_fig, viz.kv_group_layout_figure(kv.describe_groups(groups, specs), title=title,
                                                    warning=warned[0] if warned else None))
        memory = kv.group_memory(groups, layout=layout.value, kv_budget_bytes=kv_budget_bytes)
        show(memory_fig, viz.kv_group_memory_figure(
            memory, title=f"Memory per group for a {kv_budget_bytes / (1 << 30):g} GiB KV budget"))

    def on_preset(change):
        wanted = kv.PRESETS[change["new"]]["method"]  # each model comes with its own drafter
        if method.value == wanted:
            redraw()
        else:
            method.value = wanted  # the method observer redraws

    method.value = kv.PRESETS[preset.value]["method"]
    preset.observe(on_preset, names="value")
    for control in (method, sliding, layout, hybrid_off):
        control.observe(redraw, names="value")
    redraw()
    controls = [widgets.HBox([preset, method]), widgets.HBox([layout, sliding, hybrid_off])]
    return widgets.VBox([*controls, layout_fig, memory_fig])


# ---------------------------------------------------------------------------
# Chapter 5: fused kernels and the sliding window
# ---------------------------------------------------------------------------


def fused_kernel_explorer(drafter, context, positions, records, *, layers: int = 5) -> widgets.VBox:
    """Pick a context-K/V path and flip the fused Triton epilogue; see parity and what it costs.

    Each change sets the process-wide switch (``kernels.set_fused``), re-runs
    ``drafter.precompute_context_kv`` on ``context`` against the reference path,
    reports the largest errors and what actually ran here, and highlights the
    chosen path in ``viz.context_kv_timing_figure`` of ``records`` (timings from
    a GPU: live, or benchmarks/context_kv.json). The returned box exposes
    ``.path``, ``.fused``, ``.dtype``, ``.layers``, ``.parity`` and ``.figure``.
    """
    import copy
    import time

    import plotly.graph_objects as go
    import torch

    from dflash_lab import kernels, viz
    from dflash_lab.drafter import CONTEXT_KV_PATHS

    depths = sorted({r["layers"] for r in records})
    path = widgets.ToggleButtons(options=list(CONTEXT_KV_PATHS), value="folded", description="path")
    fused = widgets.Checkbox(value=kernels.fused_enabled(), description="fused Triton epilogue (folded path)")
    dtype = widgets.ToggleButtons(options=["float32", "bfloat16"], value="float32", description="dtype")
    depth = widgets.Dropdown(options=depths, value=layers if layers in depths else depths[-1],
                             description="timings for L", layout=widgets.Layout(width="180px"))
    parity = widgets.HTML()
    runnable = kernels.triton is not None and context.is_cuda
    copies = {}

    def measure():
        kernels.set_fused(fused.value)
        dt = getattr(torch, dtype.value)
        if dtype.value not in copies:
            copies[dtype.value] = drafter if next(drafter.parameters()).dtype == dt else copy.deepcopy(drafter).to(dt)
        model, ctx = copies[dtype.value], context.to(dt)
        with torch.no_grad():
            ref = model.precompute_context_kv(ctx, positions, path="reference")
            start = time.perf_counter()
            out = model.precompute_context_kv(ctx, positions, path=path.value)
            ms = 1e3 * (time.perf_counter() - start)
        errs = [(a.float() - b.float()).abs() for a, b in zip(out, ref)]
        ran = path.value
        if path.value == "folded":
            ran = "folded + fused Triton epilogue" if kernels.fused_available(ctx) else "folded in torch"
            if fused.value and not kernels.fused_available(ctx):
                ran += " (the kernel needs a CUDA GPU; on one, this choice runs it)"
        parity.value = (f"ran here: <b>{ran}</b> on {ctx.device.type}, {dtype.value}, N = {ctx.shape[0]}: "
                        f"max |ΔK| = {errs[0].max():.2e}, max |ΔV| = {errs[1].max():.2e}, mean |ΔK| = {errs[0].mean():.1e} "
                        f"against the reference · {ms:.1f} ms")

    def figure():
        chosen = "folded_triton" if path.value == "folded" and fused.value else path.value
        return viz.context_kv_timing_figure(records, layers=depth.value, highlight=chosen)

    measure()
    fig = go.FigureWidget(figure())

    def redraw(*_):
        measure()
        _redraw_figure_widget(fig, figure())

    for control in (path, fused, dtype, depth):
        control.observe(redraw, names="value")
    note = widgets.HTML("" if runnable else "<i>No CUDA GPU here: the fused kernel cannot run, the switch only "
                        "changes which bar is highlighted (the timings come from a GPU run).</i>")
    box = widgets.VBox([widgets.HBox([path, depth]), widgets.HBox([fused, dtype]), note, parity, fig])
    box.path, box.fused, box.dtype, box.layers, box.parity, box.figure = path, fused, dtype, depth, parity, fig
    return box


def window_acceptance_explorer(target, drafter, prompts, *, block_size: int = 8, max_new_tokens: int = 24,
                               window: int = 16, results: dict | None = None, max_window: int = 128,
                               context_len: int = 24) -> widgets.VBox:
    """Turn the drafter's sliding window on/off and size it; see the mask and the acceptance it gives.

    The mask part is ``sliding_window_explorer``; each window also runs
    ``spec_decode.generate_on_prompts`` with ``drafter.with_window`` on
    ``prompts`` (``results``, window -> SpecDecodeStats with None for full
    attention, seeds the cache) and draws ``viz.compare_acceptance_figure``
    against full attention. The returned box exposes ``.sliding``, ``.window``,
    ``.mask``, ``.figure``, ``.summary`` and ``.results``.
    """
    import plotly.graph_objects as go

    from dflash_lab import viz
    from dflash_lab.drafter import with_window
    from dflash_lab.spec_decode import generate_on_prompts

    mask = sliding_window_explorer(context_len=context_len, block_size=block_size, window=window)
    mask.window.max, mask.window.continuous_update = max_window, False
    results = {} if results is None else results
    summary = widgets.HTML()

    def stats_for(w):
        if w not in results:
            summary.value = "<i>generating…</i>"
            results[w], _ = generate_on_prompts(target, with_window(drafter, w), prompts, max_new_tokens=max_new_tokens,
                                                block_size=block_size, progress=False)
        return results[w]

    def figure():
        w = mask.window.value if mask.sliding.value else None
        full, now = stats_for(None), stats_for(w)
        label = f"window {w}" if w is not None else "window off (= full)"
        summary.value = (f"{len(prompts)} prompts × {max_new_tokens} tokens, block {block_size}: mean acceptance length "
                         f"<b>{now.mean_acceptance_length:.3f}</b> with {label}, {full.mean_acceptance_length:.3f} "
                         "with full attention")
        return viz.compare_acceptance_figure({"full attention": full, label: now},
                                             title=f"Acceptance: full attention vs {label}")

    fig = go.FigureWidget(figure())

    def redraw(*_):
        _redraw_figure_widget(fig, figure())

    mask.sliding.observe(redraw, names="value")
    mask.window.observe(redraw, names="value")
    box = widgets.VBox([mask, summary, fig])
    box.sliding, box.window, box.mask, box.figure, box.summary, box.results = (
        mask.sliding, mask.window, mask, fig, summary, results)
    return box


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------
