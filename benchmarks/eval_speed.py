"""The default runs' held-out evaluation: greedy completions through the training sampler's fast
paths (the lean loop and the fused CPU step) against ``model.generate``, alternating in one process.

Usage: ``.venv/bin/python benchmarks/eval_speed.py [--problems 50] [--rounds 2]``
Prints one line per measurement: the path, the seconds, and the accuracy and format it found.
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.data.tasks import arithmetic_heldout
from posttrain.models.loading import resolve_model_path
from posttrain.rewards import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    # the default GRPO run's held-out problems (one worked example, operands up to 20)
    problems = arithmetic_heldout(distinct=True, few_shot=1, max_value=20, system_prompt=None)
    problems = problems.select(range(args.problems))
    fast_generator = evaluate.TransformersGenerator
    for _ in range(args.rounds):
        for fast in (False, True):
            # without the generator class, task_accuracy runs model.generate
            evaluate.TransformersGenerator = fast_generator if fast else (lambda *a, **k: None)
            start = time.perf_counter()
            result = evaluate.task_accuracy(model, tok, problems, max_new_tokens=64)
            seconds = time.perf_counter() - start
            print("fast" if fast else "generate", round(seconds, 1), result, flush=True)
    evaluate.TransformersGenerator = fast_generator


if __name__ == "__main__":
    main()
