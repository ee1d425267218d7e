#!/usr/bin/env bash
# Regenerates both locks from pyproject.toml with pip-tools (`pip install pip-tools==7.6.2`, in any venv but the
# project's). Arguments go to the CPU compile, e.g. `tools/lock.sh --upgrade-package transformers`.
#   requirements.lock      torch's CPU build (torch-cpu.txt), what CI tests; installed after torch-cpu.lock
#   requirements-gpu.lock  PyPI's torch (torch-gpu.txt, the CUDA build) with its CUDA libraries; every package the
#                          two share at the CPU lock's version
# The CPU compile needs torch's CPU wheel visible to pip: the PyTorch CPU index by default, or, with
# TORCH_CPU_INDEX= (empty), wherever pip's own configuration finds it (a wheel folder). The GPU compile runs
# with pip's default configuration (PyPI only), as a user's machine would.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUSTOM_COMPILE_COMMAND="tools/lock.sh"
common=(--extra llama-cpp --extra ray --extra test --strip-extras --allow-unsafe --no-emit-index-url
        --no-emit-find-links)
torch_cpu_index=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
pip-compile "${common[@]}" ${torch_cpu_index:+--extra-index-url "$torch_cpu_index"} -c torch-cpu.txt \
  -o requirements.lock "$@" pyproject.toml
# pip-compile keeps the pins it finds in its output file: seeded with the CPU lock, the GPU lock differs from it
# only where the CUDA build needs other packages (tests/test_locks.py checks that the shared ones agree).
grep -v '^torch==' requirements.lock >requirements-gpu.lock
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX PIP_CONFIG_FILE=/dev/null \
  pip-compile "${common[@]}" -c torch-gpu.txt -o requirements-gpu.lock pyproject.toml
