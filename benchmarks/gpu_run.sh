#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md in one go: posttrain against TRL on the anchor config on a CUDA
# device, in bf16 and fp32, at 64, 256 and 1024 completion tokens, plus posttrain's phase profile.
#
# Usage: bash benchmarks/gpu_run.sh SOURCE OUT [64|256|1024|profile ...]
#   SOURCE: a folder with SmolLM2-135M-Instruct's config.json and tokenizer files (the weights are
#           drawn at random by benchmarks/random_model.py; the work per step is the same).
#   OUT:    where the JSON lines and logs go.
# Needs python3 with torch (CUDA), transformers, datasets, accelerate and trl==1.16.0 importable.
set -uo pipefail
src=$1
out=$2
model=/tmp/smollm2-random
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/versions.txt"
import torch, transformers, trl, datasets, accelerate
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "trl", trl.__version__, "datasets", datasets.__version__,
      "accelerate", accelerate.__version__)
PY
python3 benchmarks/random_model.py --source "$src" --out "$model" || exit 1
compare() {  # budget_s bf16 length steps
    timeout "$1" python3 benchmarks/compare.py --device cuda --bf16 "$2" --model "$model" \
        --lengths "$3" --rounds 1 --steps "$4" 2>>"$out/errors.log" | tee -a "$out/compare.txt"
}
# what to run: the rest of the arguments (default: 64 256 1024 profile); budgets in seconds
shift 2
items=${*:-64 256 1024 profile}
for item in $items; do
    case $item in
        64)
            compare 100 1 64 4
            compare 90 0 64 4
            ;;
        1024) compare 170 1 1024 3 ;;
        profile)
            timeout 60 python3 benchmarks/profile_step.py --device cuda --bf16 1 --model "$model" --steps 4 \
                2>>"$out/errors.log" | tail -1 | tee -a "$out/profile.txt"
            ;;
        *) compare 100 1 "$item" 4 ;;
    esac
done
