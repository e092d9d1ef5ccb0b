#!/usr/bin/env bash
# Remake requirements/lock/{cpu,dev}.txt: the exact set of packages that the CPU install from the .txt inputs puts
# into a fresh environment, each with the sha256 hashes of its files on the registry (uv pip compile
# --generate-hashes, --no-deps: the set is taken as installed, not resolved again).
#   bash scripts/lock.sh        # with uv on the PATH (pinned in requirements/dev.txt), online
# torch is left out: scripts/install_torch.sh installs its CPU build, which PyTorch's own index serves.
# tests/unit/test_lock.py checks that the lock still satisfies the inputs and that the inputs are the ones locked.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# --all: setuptools too (an input pins it); pip itself stays the environment's own
freeze() { "$work/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -i '^\(torch\|pip\)==' | LC_ALL=C sort; }
(source "$work/venv/bin/activate" && bash scripts/install.sh --unlocked --no-dev)
freeze > "$work/runtime.in"
"$work/venv/bin/python" -m pip install --quiet -r requirements/dev.txt
freeze | LC_ALL=C comm -13 "$work/runtime.in" - > "$work/dev.in"
inputs=$(sha256sum requirements/cpu.txt requirements/common.txt requirements/no-deps-cpu.txt requirements/dev.txt)
for name in cpu dev; do
  input="$work/runtime.in"; [[ $name == dev ]] && input="$work/dev.in"
  {
    echo "# The CPU install's $name packages, exact versions with sha256 hashes: made by scripts/lock.sh, do not edit."
    echo "# Linux x86_64, Python 3.11; installed with pip install --require-hashes --no-deps (scripts/install.sh)."
    echo "# Made from these inputs (tests/unit/test_lock.py checks they are unchanged):"
    echo "$inputs" | sed 's/^/#   /'
    uv pip compile --quiet --no-deps --generate-hashes --no-header --no-annotate --python-version 3.11 \
      --python-platform x86_64-manylinux_2_28 "$input"
  } > "requirements/lock/$name.txt"
done
echo "scripts/lock.sh: $(grep -c '==' requirements/lock/cpu.txt) runtime and $(grep -c '==' requirements/lock/dev.txt)" \
     "dev packages locked"
