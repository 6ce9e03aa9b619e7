"""The default runs' held-out evaluation: greedy completions through the training sampler's fast
paths (the lean loop and the fused CPU step, with and without the prompts' common opening
prefilled once) against ``model.generate``, alternating in one process.

Usage: ``.venv/bin/python benchmarks/eval_speed.py [--problems 50] [--rounds 2]``
Prints one line per measurement: the path, the seconds, and the accuracy and format it found;
then how many completions each fast path shares character for character with ``generate``'s.
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

    def lean_whole_prompts(*args: object, **kwargs: object) -> object:
        return fast_generator(*args, **kwargs, share_prefix=False)

    paths = {
        "generate": lambda *a, **k: None,
        "lean": lean_whole_prompts,
        "lean+common_prefix": fast_generator,
    }
    completions: dict[str, list[str]] = {}
    decode = tok.batch_decode
    for _ in range(args.rounds):
        for name, generator in paths.items():
            # without a generator (None), task_accuracy runs model.generate
            evaluate.TransformersGenerator = generator
            completions[name] = []
            tok.batch_decode = lambda *a, _out=completions[name], **k: (
                _out.extend(decode(*a, **k)) or _out[-len(a[0]) :]
            )
            start = time.perf_counter()
            result = evaluate.task_accuracy(model, tok, problems, max_new_tokens=64)
            seconds = time.perf_counter() - start
            tok.batch_decode = decode
            print(name, round(seconds, 1), result, flush=True)
    evaluate.TransformersGenerator = fast_generator
    for name in ("lean", "lean+common_prefix"):
        same = sum(a == b for a, b in zip(completions[name], completions["generate"], strict=True))
        print(f"{name}: {same} of {len(problems)} completions equal generate's")


if __name__ == "__main__":
    main()
