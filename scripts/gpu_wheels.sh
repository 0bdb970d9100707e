#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, transformers, triton and safetensors but no network: the rest of
# what the chapters and the GPU tests import, downloaded here for its Python (3.12 by default) into .whl/
# (ignored by git). There: python -m pip install --no-index --find-links .whl <the packages below>.
#
#   PYVER=3.12 scripts/gpu_wheels.sh
set -euo pipefail
PYVER=${PYVER:-3.12}
PACKAGES=(pytest plotly anywidget ipywidgets nbclient nbformat ipykernel tqdm)
mkdir -p .whl
python3 -m pip download -q -d .whl --python-version "$PYVER" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any "${PACKAGES[@]}"
echo "wheels in .whl ($(du -sh .whl | cut -f1)); install there with:"
echo "  python -m pip install --no-index --find-links .whl ${PACKAGES[*]}"
