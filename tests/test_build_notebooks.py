"""`notebooks/build_notebooks.py --execute`: committed notebooks keep the small printouts nbval checks, nothing bulky."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

BUILDER = Path(__file__).resolve().parents[1] / "notebooks" / "build_notebooks.py"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_cell(source, outputs):
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    return cell


STDOUT = {"output_type": "stream", "name": "stdout", "text": "tau = 1.82\n"}
STDERR = {"output_type": "stream", "name": "stderr", "text": "UserWarning: something\n"}
PLOTLY = {"output_type": "display_data", "metadata": {}, "data": {"application/vnd.plotly.v1+json": {"data": []}}}
WIDGET = {"output_type": "display_data", "metadata": {},
          "data": {"text/plain": "IntSlider(value=4)", "application/vnd.jupyter.widget-view+json": {"model_id": "x"}}}
RESULT = {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": "[0.5, 0.25]"}}


def test_keep_small_outputs_keeps_printouts_and_drops_bulk():
    builder = load_builder()
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.cells = [
        code_cell("print(tau)\nrates", [STDOUT, RESULT]),
        code_cell("print(tau)\nfig.show()", [STDOUT, PLOTLY]),
        code_cell("# NBVAL_IGNORE_OUTPUT\nprint(time.time())", [STDOUT]),
        code_cell("slider", [WIDGET]),
        code_cell("warnings.warn('x')", [STDERR]),
        code_cell("print('x' * 10_000)", [dict(STDOUT, text="x" * 10_000)]),
    ]

    out = builder.keep_small_outputs(nb, "t.ipynb")

    kept = [[o.get("name") or o.output_type for o in c.outputs] for c in out.cells]
    tags = [c.metadata.get("tags", []) for c in out.cells]
    assert kept == [["stdout", "execute_result"], ["stdout"], [], [], [], []]
    # checked by nbval: only the first cell; the others lost outputs nbval would see again
    assert tags == [[], ["nbval-ignore-output"], [], ["nbval-ignore-output"], ["nbval-ignore-output"],
                    ["nbval-ignore-output"]]
    assert "widgets" not in out.metadata


@pytest.mark.slow
def test_execute_writes_a_small_notebook_that_passes_nbval(tmp_path):
    (tmp_path / "notebooks" / "src").mkdir(parents=True)
    shutil.copy(BUILDER, tmp_path / "notebooks" / "build_notebooks.py")
    (tmp_path / "notebooks" / "src" / "01_tiny.py").write_text(
        "# %% [markdown]\n# # Tiny\n\n"
        "# %%\nprint(sum(range(10)))\n\n"
        "# %%\nimport plotly.graph_objects as go\nprint('drawing')\ngo.Figure(go.Bar(y=[1, 2])).show()\n\n"
        "# %%\n# NBVAL_IGNORE_OUTPUT\nimport time\nprint(time.time())\n"
    )

    build = subprocess.run([sys.executable, "notebooks/build_notebooks.py", "--execute"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)

    assert build.returncode == 0, build.stderr
    path = tmp_path / "notebooks" / "01_tiny.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [o.text for o in code[0].outputs] == ["45\n"]
    assert [o.text for o in code[1].outputs] == ["drawing\n"] and code[1].metadata.tags == ["nbval-ignore-output"]
    assert code[2].outputs == []
    assert path.stat().st_size < 20_000
    nbval = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                            "--nbval-current-env", str(path)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert nbval.returncode == 0, nbval.stdout[-3000:]
