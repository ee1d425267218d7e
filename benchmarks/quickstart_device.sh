#!/usr/bin/env bash
# The README's GPU quickstart, run as written on the device machine, with two substitutions the machine
# forces (it reaches no network): the install line is replaced by wheels carried in .whl (see
# prepare_wheels.sh; the image's own torch/transformers/peft), and the Hub id by a local folder holding the
# Llama-3.2-1B shape with random bf16 weights and the tiny tokenizer (calibrate_memory.py's build_model).
#
# Usage (device): bash benchmarks/quickstart_device.sh "$OUT"    (.whl carried; OUT gets the logs)
set -euo pipefail
out=${1:?usage: quickstart_device.sh OUT}
repo=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
export PYTHONPATH=/tmp/site:$repo PREFECT_HOME=/tmp/qs/prefect HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
slimtune() { python3 -m slimtune.cli.main "$@"; }

mkdir -p /tmp/qs && cd /tmp/qs
python3 -c "from pathlib import Path; from benchmarks.calibrate_memory import build_model; build_model('1b', Path('.'))"
cp "$repo/deployments/data/tiny_chat.jsonl" my.jsonl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"

# The quickstart's commands, as the README writes them (model: the local folder).
{ time slimtune init --model ./model-1b --data my.jsonl --name my-1b > my-1b.yaml; } 2> "$out/init.log"
cp my-1b.yaml "$out/"
{ time slimtune plan my-1b.yaml; } > "$out/plan.log" 2>&1 || echo "plan exited $?" >> "$out/plan.log"
{ time slimtune run my-1b.yaml; } > "$out/run.log" 2>&1
printf 'What is 12 plus 30?\n\n' | slimtune chat runs/my-1b > "$out/chat.log" 2>&1
cp runs/my-1b/report.md "$out/"
tail -3 "$out/run.log"
