"""Static HTML for a notebook's figures and widget views, and the page template.

Used by ``tools.report``: plotly figures become divs drawn by the page's one
inlined copy of plotly.js; each widget view is drawn from its saved state as a
static snapshot (sliders, dropdowns and toggles at their values, progress bars,
HTML, and each plotly ``FigureWidget`` with the figure the kernel last held), and a
view that holds controls says so: they show the last state and do not respond.
The page requests nothing from the network: no MathJax (the chapters write no LaTeX)
and no Mermaid, whose loaders nbconvert's template would fetch from a CDN.
"""

from __future__ import annotations

import html
import re

import jinja2
import plotly.io as pio
import plotly.offline
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# ---------------------------------------------------------------------------
# Static HTML for figures and widget views
# ---------------------------------------------------------------------------


def figure_html(figure: dict) -> str:
    """A plotly div that draws with the page's inlined plotly.js."""
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, validate=False)


def _label(state: dict) -> str:
    d = state.get("description") or ""
    return f'<span class="dflash-w-label">{html.escape(d)}</span>' if d else ""


def _options(state: dict) -> tuple[list[str], set[int]]:
    labels = state.get("_options_labels") or []
    index = state.get("index")
    chosen = set(index) if isinstance(index, (list, tuple)) else ({index} if isinstance(index, int) else set())
    return labels, chosen


def widget_html(model_id: str, models: dict, figures: dict, _depth: int = 0) -> str:
    """Static HTML for the widget `model_id`, from its saved state (children recursively)."""
    model = models.get(model_id)
    if model is None or _depth > 50:
        return ""  # closed before the end (a tqdm bar with leave=False): JupyterLab shows nothing either
    name = model.get("model_name", "")
    state = model.get("state", {})
    esc = html.escape
    layout = models.get(str(state.get("layout", "")).removeprefix("IPY_MODEL_"), {}).get("state", {})
    if layout.get("visibility") == "hidden" or layout.get("display") == "none":
        return ""  # hidden by its layout (tqdm hides a finished leave=False bar this way too): not drawn

    def child(ref):
        return widget_html(str(ref).removeprefix("IPY_MODEL_"), models, figures, _depth + 1)

    if model_id in figures:  # a plotly FigureWidget
        return f'<div class="dflash-w-figure">{figure_html(figures[model_id])}</div>'
    if name in ("HBoxModel", "VBoxModel", "BoxModel", "GridBoxModel"):
        direction = "row" if name == "HBoxModel" else "column"
        kids = "".join(child(c) for c in state.get("children", []))
        return f'<div class="dflash-w-box" style="flex-direction:{direction}">{kids}</div>'
    if name in ("TabModel", "AccordionModel", "StackModel"):
        titles = state.get("titles") or []
        parts = []
        for i, c in enumerate(state.get("children", [])):
            title = titles[i] if i < len(titles) and titles[i] else f"{i}"
            parts.append(f'<div class="dflash-w-tab"><div class="dflash-w-tab-title">{esc(title)}</div>'
                         f'{child(c)}</div>')
        return f'<div class="dflash-w-tabs">{"".join(parts)}</div>'
    if name == "OutputModel":
        outputs = "".join(output_html(o, figures) for o in state.get("outputs", []))
        return f'<div class="dflash-w-output">{outputs}</div>'
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="dflash-w-html">{_label(state)}{state.get("value", "")}</div>'
    if name == "LabelModel":
        return f'<div class="dflash-w-html">{esc(str(state.get("value", "")))}</div>'
    if name in ("FloatProgressModel", "IntProgressModel"):
        lo, hi, v = state.get("min", 0), state.get("max", 100), state.get("value", 0)
        return (f'<div class="dflash-w-row">{_label(state)}<progress value="{v - lo}" max="{hi - lo}">'
                f"</progress></div>")
    if name.endswith("SliderModel") and "_options_labels" not in state:
        v = state.get("value")
        text = "–".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
        first = v[0] if isinstance(v, (list, tuple)) else v
        return (f'<div class="dflash-w-row">{_label(state)}<input type="range" disabled min="{state.get("min")}" '
                f'max="{state.get("max")}" step="{state.get("step") or "any"}" value="{first}">'
                f'<span class="dflash-w-value">{esc(text)}</span></div>')
    if "_options_labels" in state:  # dropdowns, selects, radio and toggle buttons, selection sliders
        labels, chosen = _options(state)
        if name in ("ToggleButtonsModel", "RadioButtonsModel"):
            items = "".join(
                f'<span class="dflash-w-option{" dflash-w-chosen" if i in chosen else ""}">{esc(l)}</span>'
                for i, l in enumerate(labels)
            )
            return f'<div class="dflash-w-row">{_label(state)}{items}</div>'
        opts = "".join(
            f'<option{" selected" if i in chosen else ""}>{esc(l)}</option>' for i, l in enumerate(labels)
        )
        multiple = " multiple" if name in ("SelectMultipleModel",) else ""
        return f'<div class="dflash-w-row">{_label(state)}<select disabled{multiple}>{opts}</select></div>'
    if name in ("CheckboxModel", "ToggleButtonModel", "ValidModel"):
        checked = " checked" if state.get("value") else ""
        return (f'<div class="dflash-w-row"><label><input type="checkbox" disabled{checked}> '
                f'{esc(state.get("description", ""))}</label></div>')
    if name == "ButtonModel":
        return f'<div class="dflash-w-row"><button disabled>{esc(state.get("description", ""))}</button></div>'
    if "value" in state and isinstance(state["value"], (str, int, float)):  # text boxes, pickers
        return (f'<div class="dflash-w-row">{_label(state)}<input disabled '
                f'value="{esc(str(state["value"]))}"></div>')
    return f'<span class="dflash-w-missing">({esc(name)})</span>'


def output_html(output: dict, figures: dict) -> str:
    """Static HTML for one nbformat output captured by an Output widget."""
    kind = output.get("output_type")
    if kind == "stream":
        return f'<pre class="dflash-w-stream">{html.escape(output.get("text", ""))}</pre>'
    if kind == "error":
        traceback = ANSI.sub("", "\n".join(output.get("traceback", [])))
        return f'<pre class="dflash-w-stream">{html.escape(traceback)}</pre>'
    data = output.get("data", {})
    if PLOTLY_MIME in data:
        return figure_html(data[PLOTLY_MIME])
    if WIDGET_VIEW_MIME in data:
        return f"<!-- nested widget {data[WIDGET_VIEW_MIME].get('model_id')} -->"
    if "text/html" in data:
        return data["text/html"]
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}">'
    return f'<pre class="dflash-w-stream">{html.escape(data.get("text/plain", ""))}</pre>'


# Widget models a reader would try to use: in a report they are pictures of their last state.
CONTROL_MODELS = ("SliderModel", "DropdownModel", "ToggleButtonsModel", "RadioButtonsModel", "CheckboxModel",
                  "ToggleButtonModel", "TextModel", "TextareaModel", "ButtonModel", "PlayModel", "SelectModel",
                  "SelectMultipleModel", "IntTextModel", "FloatTextModel", "BoundedIntTextModel",
                  "BoundedFloatTextModel", "ComboboxModel")
SNAPSHOT_NOTE = ('<div class="dflash-w-snapshot-note">Static snapshot: these controls show their last state and do '
                 "not respond in this page. Open the notebook in JupyterLab to use them.</div>")


def has_controls(model_id: str, models: dict, _depth: int = 0) -> bool:
    """Whether the widget ``model_id`` (or any child) is a control a reader would try to move."""
    model = models.get(model_id)
    if model is None or _depth > 50:
        return False
    if model.get("model_name", "").endswith(CONTROL_MODELS):
        return True
    return any(has_controls(str(c).removeprefix("IPY_MODEL_"), models, _depth + 1)
               for c in model.get("state", {}).get("children", []))


# Lines on stderr known to be harmless here, each matched whole: what importing the lab's vLLM 0.33
# (a CUDA wheel, used for its configs and KV-cache grouping) and torch say on a CPU-only machine.
# JupyterLab draws stderr in a red box, which a reader takes for an error; the report leaves these
# lines out (counted in its log) and keeps every other stderr line, so no real error is hidden.
_VLLM_LOG_PREFIX = r"(?:(?:INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] )?"
KNOWN_STDERR_NOISE = [re.compile(p) for p in (
    # torch's own deprecation notices, raised inside torch while vLLM imports it
    r"W\d{4} [\d:.]+ +\d+ torch/[\w/]+\.py:\d+\] [\w.=' ]+ is deprecated, use [\w.=' ]+ instead",
    r"W\d{4} [\d:.]+ +\d+ torch/utils/cpp_extension\.py:\d+\] No CUDA runtime is found, using CUDA_HOME='[^']*'",
    # vLLM 0.33 probing a CPU-only machine for what its CUDA wheel would use
    _VLLM_LOG_PREFIX + r"Model Runner V2 requires Triton; using the V1 model runner instead\.",
    _VLLM_LOG_PREFIX + r"Failed to import from vllm\._C: ModuleNotFoundError\(\"No module named 'vllm\._C'\"\)",
    _VLLM_LOG_PREFIX + r"Triton is not installed\. triton-cpu is expected on x86 CPUs\.",
    _VLLM_LOG_PREFIX + r"Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'\.",
)]


def drop_known_stderr_noise(nb) -> int:
    """Remove KNOWN_STDERR_NOISE lines from the notebook's stderr outputs (an output left empty goes);
    returns how many lines went. Every other line stays."""
    dropped = 0
    for cell in nb.cells:
        kept_outputs = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines = out.get("text", "").splitlines(keepends=True)
                kept = [line for line in lines
                        if not any(p.fullmatch(ANSI.sub("", line).rstrip("\r\n")) for p in KNOWN_STDERR_NOISE)]
                dropped += len(lines) - len(kept)
                if not "".join(kept).strip():
                    continue
                out["text"] = "".join(kept)
            kept_outputs.append(out)
        if "outputs" in cell:
            cell.outputs = kept_outputs
    return dropped


def prepare_for_html(nb, figures: dict) -> None:
    """Give every figure and widget output a static rendering; slim the saved widget state."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_MIME, {})
    models = state.get("state", {})
    for cell in nb.cells:
        if "outputs" in cell:  # a view of a widget the kernel closed (tqdm, leave=False): JupyterLab removes it,
            cell.outputs = [out for out in cell.outputs  # and its text/plain stand-in is a stale picture of it
                            if out.get("data", {}).get(WIDGET_VIEW_MIME, {}).get("model_id", "") in models
                            or WIDGET_VIEW_MIME not in out.get("data", {})]
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                data["text/html"] = figure_html(data[PLOTLY_MIME])
                del data[PLOTLY_MIME]  # drawn by the text/html above
            if WIDGET_VIEW_MIME in data:
                model_id = data[WIDGET_VIEW_MIME].get("model_id", "")
                note = SNAPSHOT_NOTE if has_controls(model_id, models) else ""
                out.setdefault("metadata", {})["dflash_lab_static_html"] = note + widget_html(model_id, models, figures)
    for model_id, model in models.items():
        if model_id in figures or "_esm" in model.get("state", {}):
            # the anywidget bundle (plotly.js again, ~5 MB per figure): the page draws from its own copy
            model["state"]["_esm"] = "export default { render() {} };"


# Extends JupyterLab's look: plotly.js inlined before anything else, no script
# from a CDN (require.js, the widget manager), widget views drawn statically.
REPORT_TEMPLATE = r"""
{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}
<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>
<script type="text/javascript">{{ resources.dflash_lab_plotly_js }}</script>
{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block extra_css %}
<style type="text/css">
.dflash-widget-snapshot { font-family: var(--jp-ui-font-family); font-size: var(--jp-ui-font-size1); }
.dflash-w-box { display: flex; gap: 6px; flex-wrap: wrap; }
.dflash-w-row { display: flex; align-items: center; gap: 8px; margin: 2px 0; font-size: 13px; }
.dflash-w-label { min-width: 90px; text-align: right; }
.dflash-w-value { font-family: monospace; }
.dflash-w-option { border: 1px solid #bbb; padding: 2px 8px; border-radius: 3px; }
.dflash-w-chosen { background: #1976d2; color: white; border-color: #1976d2; }
.dflash-w-figure, .dflash-w-output { width: 100%; }
.dflash-w-tab-title { font-weight: bold; margin-top: 6px; }
.dflash-w-stream { margin: 0; }
.dflash-w-missing { color: #999; font-style: italic; }
.dflash-w-snapshot-note { font-size: 12px; color: #555; background: #fff7e0; border-left: 3px solid #E69F00;
                          padding: 2px 8px; margin: 2px 0 4px 0; }
.dflash-w-html progress { width: 200px; }
</style>
{% endblock extra_css %}
{%- block data_widget_view scoped %}
<div class="jupyter-widgets jp-OutputArea-output dflash-widget-snapshot {{ extra_class }}">
<script type="application/vnd.jupyter.widget-view+json">
{{ output.data['application/vnd.jupyter.widget-view+json'] | json_dumps | escape_html_script }}
</script>
{{ output.metadata.get('dflash_lab_static_html', '') }}
</div>
{%- endblock data_widget_view -%}
"""


GLOSSARY = "GLOSSARY.md"  # notebooks/GLOSSARY.md: chapters link to it as GLOSSARY.md#anchor


def glossary_page(markdown_text: str) -> str:
    """The glossary as a small self-contained HTML page (its <a id> anchors kept)."""
    body = markdown2html_mistune(markdown_text)
    return ('<!doctype html><html><head><meta charset="utf-8"><title>Glossary</title><style>body{font-family:'
            'sans-serif;max-width:52em;margin:2em auto;line-height:1.5} code{background:#f4f4f4}</style></head>'
            f"<body>{body}</body></html>")


def to_html(nb, figures: dict, title: str) -> str:
    """The executed notebook as one self-contained page (plotly.js inlined, widgets drawn statically);
    links to the glossary point at the report's own GLOSSARY.html."""
    prepare_for_html(nb, figures)
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[jinja2.DictLoader({"dflash_lab_report.html.j2": REPORT_TEMPLATE})],
        template_file="dflash_lab_report.html.j2",
    )
    resources = {"metadata": {"name": title}, "dflash_lab_plotly_js": plotly.offline.get_plotlyjs()}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return body.replace(f'href="{GLOSSARY}', 'href="GLOSSARY.html')
