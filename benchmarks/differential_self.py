"""Differential check of posttrain's self-distillation trainers (SDFT, SDPO) against the reference (TRL 1.16).

Run in the benchmark environment, where both libraries are installed::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_self.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_self.py --only sdft sdpo

``SDFTTrainer`` / ``SDFTConfig`` (reference: ``trl.experimental.sdft``) and ``SDPOTrainer`` /
``SDPOConfig`` (``trl.experimental.sdpo``). Both sample from the student, and neither reference
trainer takes a ``rollout_func``, so each library's generation is replaced in place by the same
scripted completions (``differential_online.Script``, a function of the row's prompt tokens, its
index in the group and the call number, from ``differential.rollout_plan``: some end with EOS,
some are cut at ``max_completion_length`` without it):

- the reference: ``trainer._generate(prompt_ids)`` (the method that dispatches to its
  transformers or vLLM sampling; it gets one prompt per row, each repeated ``num_generations``
  times, and returns ``(prompt_ids, completion_ids)``), replaced by one that returns the rows'
  prompt ids and the scripted completions;
- posttrain: its generator (``trainer.generator``, the same object as ``trainer.sampler.generator``,
  whose ``generate(prompt_ids, prompt_mask)`` returns ``Samples``), replaced by one that returns
  the scripted completions.

Everything after generation is each library's own: the teacher prompts (SDFT: the template with
the row's ``privileged_context``; SDPO: the reprompt with a successful sibling's decoded completion
and, where asked, the row's feedback), the teacher (start, live or EMA weights), the losses and the
metrics. SDPO's reward is a deterministic function of the completion tokens with values 0, 0.5
and 1, so that some groups hold successes and failures (the reprompting path) and a second
threshold changes which rows succeed. The tiny seeded Llama whose pad token is EOS, the driver and
the comparison of every metric both log (relative 1e-4 / absolute 1e-6) and of the parameters after
3 plain-SGD steps are ``differential.py``'s (learning rate 0.1 for SDPO, ``SDFT_LR`` for SDFT, whose
loss starts near 1e-4).

Nothing here is copied from the reference; it only calls both libraries' public API and replaces
one generation method of each.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from differential import (  # noqa: E402
    BASE,
    PROMPTS,
    command_line,
    drive_tiny,
    generation_calls_note,
    record_failure,
    record_run,
)
from differential_online import Script, script_posttrain  # noqa: E402

#: Both families' options: 2 prompts x 4 completions per step, 3 plain-SGD steps.
SELF_BASE = {
    **{k: v for k, v in BASE.items() if k != "log_completions"},  # not a field of either reference config
    "learning_rate": 0.1,
    "max_grad_norm": 0.0,
}

#: SDFT's step size: its loss (the model against itself with a context) is near 1e-4 at the start,
#: so plain SGD at 0.1 would barely move the weights and the live and EMA teachers would look alike.
SDFT_LR = 5.0

#: What only SDFT's teacher reads, one per prompt.
PRIVILEGED = [
    "The answer is 5.",
    "Blue is a colour.",
    "one two three",
    "Say: hello there.",
    "The word is cat.",
    "The sky is blue and the sun is bright.",
    "Seven is a number.",
    "A cat learns arithmetic.",
]

#: name -> overrides. Names starting with ``sdft`` run SDFT, ``sdpo`` SDPO.
CONFIGS: dict[str, dict] = {
    # SDFT: the base (start weights) teacher, topk_logits over 100 tokens, alpha 0.5
    "sdft": {},
    "sdft_full_logits": {"distillation_mode": "full_logits"},
    "sdft_full_forward_kl": {"distillation_mode": "full_logits", "distillation_alpha": 0.0},
    "sdft_full_reverse_kl": {"distillation_mode": "full_logits", "distillation_alpha": 1.0},
    "sdft_topk_tail": {"distillation_topk": 20, "distillation_add_tail": True, "distillation_alpha": 0.3},
    "sdft_sampled_token": {"distillation_mode": "sampled_token", "distillation_alpha": 1.0},
    "sdft_live": {"teacher_model_kind": "live"},
    "sdft_ema": {"teacher_model_kind": "ema", "teacher_update_rate": 0.5},
    "sdft_ema_sync_2": {"teacher_model_kind": "ema", "teacher_update_rate": 0.5, "teacher_sync_steps": 2},
    "sdft_skip_tokens": {"num_loss_tokens_to_skip": 2},
    "sdft_num_iterations_2": {"num_iterations": 2},
    "sdft_temperature": {"temperature": 0.7},
    # SDPO: the EMA teacher, sampled_token (reverse KL), distillation_weight 1, threshold 1.0
    "sdpo": {},
    "sdpo_reprompt_self": {"dont_reprompt_on_self_success": False},
    "sdpo_threshold": {"success_reward_threshold": 0.5},
    "sdpo_feedback": {"include_environment_feedback": True},
    "sdpo_feedback_without_solution": {
        "include_environment_feedback": True,
        "environment_feedback_only_without_solution": True,
    },
    "sdpo_feedback_only": {"include_environment_feedback": True, "use_successful_as_teacher": False},
    "sdpo_weight_half": {"distillation_weight": 0.5},
    "sdpo_policy_only": {"distillation_weight": 0.0},
    "sdpo_topk": {"distillation_mode": "topk_logits", "distillation_topk": 20, "distillation_alpha": 0.5},
    "sdpo_ema_rate": {"teacher_update_rate": 0.5},
    "sdpo_num_iterations_2": {"num_iterations": 2, "distillation_weight": 0.5},
    "sdpo_mask_truncated": {"mask_truncated_completions": True, "distillation_weight": 0.5},
    "sdpo_grpo_loss": {"loss_type": "grpo", "distillation_weight": 0.5},
}


def graded_reward(completion_ids, **kwargs):
    """0, 0.5 or 1 from the completion's tokens: a success reaches the threshold (1.0 by default)."""
    return [float(sum(ids) % 3) / 2 for ids in completion_ids]


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    sdpo = name.startswith("sdpo")
    if lib == "trl" and sdpo:
        from trl.experimental.sdpo import SDPOConfig as Config
        from trl.experimental.sdpo import SDPOTrainer as Trainer
    elif lib == "trl":
        from trl.experimental.sdft import SDFTConfig as Config
        from trl.experimental.sdft import SDFTTrainer as Trainer
    elif sdpo:
        from posttrain import SDPOConfig as Config
        from posttrain import SDPOTrainer as Trainer
    else:
        from posttrain import SDFTConfig as Config
        from posttrain import SDFTTrainer as Trainer
    script = Script(AutoTokenizer.from_pretrained(model_dir))
    result: dict = {"lib": lib, "config": name}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            family = {} if sdpo else {"learning_rate": SDFT_LR}
            args = Config(output_dir=tmp, **{**SELF_BASE, **family, **CONFIGS[name]})
            dataset = Dataset.from_dict({"prompt": PROMPTS, "privileged_context": PRIVILEGED})
            extra = {"reward_funcs": [graded_reward]} if sdpo else {}
            trainer = Trainer(model=model_dir, args=args, train_dataset=dataset, **extra)
            if lib == "trl":
                trainer._generate = lambda prompt_ids: (prompt_ids, script.completions(prompt_ids))
            else:
                script_posttrain(trainer, script)
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        result["calls"] = script.calls
        record_run(out_path, result, trainer)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    return drive_tiny(
        names, keep, verbose, os.path.abspath(__file__), "differential-self-", generation_calls_note
    )


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
