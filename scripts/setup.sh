#!/usr/bin/env bash
# One-time set-up: installs PyTorch 2.11.0 (the libtorch that `tch` 0.24 builds against), and
# tqdm, accelerate and TensorBoard (the drop-in tests run them) and transformers (the GPT-2
# peer of scripts/bench/vs_pytorch_gpt2.sh), into a cache directory outside
# the repository, reuses it on later runs, and writes the git-ignored
# `.cargo/config.toml` that tells `cargo build` where libtorch is. Safe to run repeatedly.
#
#   GPTREC_CACHE   where the cache lives (default: ${XDG_CACHE_HOME:-$HOME/.cache}/gptrec)
#   PYTHON         the Python 3 interpreter to use (default: python3)
#
# Source it (`. scripts/setup.sh`) to also get LIBTORCH and the venv's bin/ (torchrun) exported.
gptrec_setup() {
  local torch_version="2.11.0"
  local repo cache venv python marker site
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cache="${GPTREC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gptrec}"
  venv="$cache/torch-$torch_version"
  python="${PYTHON:-python3}"
  marker="$venv/.gptrec-complete"

  if [ -f "$marker" ]; then
    echo "setup: reusing torch $torch_version in $venv"
  else
    if ! command -v "$python" >/dev/null 2>&1; then
      echo "setup: error: '$python' not found; install Python 3.9+ or set PYTHON=/path/to/python3" >&2
      return 1
    fi
    echo "setup: installing torch==$torch_version into $venv (once; about 4 GB with its CUDA libraries)"
    mkdir -p "$cache"
    rm -rf "$venv"
    if ! "$python" -m venv "$venv"; then
      echo "setup: error: '$python -m venv $venv' failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
      return 1
    fi
    if ! "$venv/bin/python" -m pip install --quiet --progress-bar off "torch==$torch_version"; then
      echo "setup: error: 'pip install torch==$torch_version' failed (see pip's message above); nothing was kept" >&2
      rm -rf "$venv"
      return 1
    fi
    touch "$marker"
    echo "setup: torch $torch_version installed"
  fi

  # The tools our users run beside launch, which the drop-in tests run for real (tqdm's bars,
  # accelerate's launcher and config file, TensorBoard's event reader), and transformers, whose
  # GPT2Model the PyTorch peer of our GPT-2 training step runs (scripts/bench/gpt2_peer.py).
  # Small next to torch; without them those tests skip with one line. A new list gets a new
  # marker name, so that a cache made before installs it.
  local peers="tqdm==4.70.1 accelerate==1.15.0 tensorboard==2.21.0 transformers==5.24.0"
  local peers_marker="$venv/.gptrec-peers-2"
  if [ ! -f "$peers_marker" ]; then
    # shellcheck disable=SC2086
    if "$venv/bin/python" -m pip install --quiet --progress-bar off $peers; then
      touch "$peers_marker"
      echo "setup: installed $peers"
    else
      echo "setup: warning: 'pip install $peers' failed; the tests that run them will skip" >&2
    fi
  fi

  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [ ! -f "$site/torch/lib/libtorch_cpu.so" ]; then
    echo "setup: error: $site/torch/lib/libtorch_cpu.so is missing; delete $venv and run again" >&2
    return 1
  fi
  # cudarc loads NCCL by the name libnccl.so, but the wheel ships libnccl.so.2 only.
  local nccl_dir="$site/nvidia/nccl/lib"
  if [ -f "$nccl_dir/libnccl.so.2" ] && [ ! -e "$nccl_dir/libnccl.so" ]; then
    ln -s libnccl.so.2 "$nccl_dir/libnccl.so"
    echo "setup: linked $nccl_dir/libnccl.so -> libnccl.so.2 (for the nccl backend)"
  fi
  export LIBTORCH="$site/torch"
  export PATH="$venv/bin:$PATH"

  # Generated, git-ignored: lets a plain `cargo build` in this repository find libtorch.
  mkdir -p "$repo/.cargo"
  local cfg="$repo/.cargo/config.toml"
  local want
  want=$(printf '# Written by scripts/setup.sh; do not edit or commit.\n[env]\nLIBTORCH = "%s"\nGPTREC_TORCH_VENV = "%s"\n' "$LIBTORCH" "$venv")
  if [ ! -f "$cfg" ] || [ "$(cat "$cfg")" != "$want" ]; then
    printf '%s\n' "$want" >"$cfg"
    echo "setup: wrote $cfg (LIBTORCH=$LIBTORCH)"
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -eu
  gptrec_setup
else
  gptrec_setup || return 1
fi
