#!/usr/bin/env bash
# The chapters on a pair at Laguna-XS.2's true widths, on a GPU: a pair of random weights is written
# in the real format (`python -m dflash_lab.user_pair --full-width`: the target sharded with an index,
# hidden 2048, 256 experts top-8, vocabulary 100352, XS.2's layer pattern; a drafter at the
# XS-2.1-DFlash preset's shape), then each chapter named runs on it as `make report` runs it, and its
# wall time is printed. Each executed notebook is kept in $OUT, so what a chapter printed about the pair can be
# read afterwards. REUSE=1 keeps a pair already built in $PAIR.
#
#   OUT=runs/xs2-chapters LAYERS=8 scripts/chapters_on_xs2_pair.sh 02 05 07 03
set -uo pipefail
OUT=${OUT:-runs/xs2-chapters}
LAYERS=${LAYERS:-8}
PAIR=${PAIR:-/tmp/xs2-pair}
PYTHON=${PYTHON:-python3}
# The chapters import the lab's own dependencies (pyproject.toml); a GPU machine without them fails in a widget
# cell minutes in (plotly's FigureWidget needs anywidget), so ask first. The kernel runs in notebooks/: the
# package is found through an absolute PYTHONPATH.
"$PYTHON" -c "import nbclient, nbformat, ipykernel, plotly, anywidget, ipywidgets, tqdm" \
  || { echo "chapters_on_xs2_pair.sh: install the lab's dependencies first (pip install -e ., or on a machine" \
       "without network the wheels scripts/gpu_wheels.sh downloads)" >&2; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
start=$(date +%s)
DEVICE=${DEVICE:-cuda}
if [ "${REUSE:-0}" != 1 ] || [ ! -f "$PAIR/target/model.safetensors.index.json" ]; then
  "$PYTHON" -m dflash_lab.user_pair --out "$PAIR" --layers "$LAYERS" --full-width --device "$DEVICE" \
    --shard-size 4GB || exit 1
fi
echo "pair: $LAYERS-layer XS.2-shaped target + XS-2.1-DFlash-shaped drafter, built in $(( $(date +%s) - start )) s" \
  | tee -a "$OUT/summary.txt"
export DFLASH_LAB_TARGET=$PAIR/target DFLASH_LAB_DRAFTER=$PAIR/drafter
for ch in "$@"; do
  nb=$(ls notebooks/"$ch"_*.ipynb)
  start=$(date +%s)
  # nbclient alone (no HTML export): run it top to bottom in a fresh kernel, as `make report` does
  timeout "${CHAPTER_TIMEOUT:-420}" "$PYTHON" -c 'import sys, nbformat, nbclient
nb = nbformat.read(sys.argv[1], as_version=4)
try:
    nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
finally:
    nbformat.write(nb, sys.argv[2])
print("ran", sys.argv[1])' "$nb" "$OUT/chapter-$ch.ipynb" > "$OUT/chapter-$ch.log" 2>&1
  rc=$?
  echo "chapter $ch: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
done
