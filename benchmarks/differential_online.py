"""Differential check of posttrain's RLOO and online DPO trainers against the reference (TRL 1.16) on identical rollouts.

Run in the benchmark environment, where both libraries are installed::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_online.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_online.py --only rloo rloo_beta_0

The reference's RLOOTrainer and OnlineDPOTrainer have no ``rollout_func``, so each library's
generation is replaced in place by the same scripted completions: the reference's RLOO
``_generate_single_turn`` (which returns each row's completion ids) and online DPO ``_generate``
(its own tokenisation and sampling kept, the sampled completions then replaced), and posttrain's
generator (``trainer.generator``, which returns ``Samples``). A completion is a deterministic function of the row's prompt tokens, its index in
the group and the call number (``differential.rollout_plan``: some end with EOS, some are cut at
``max_completion_length`` without it). Rewards are deterministic functions of the completion
tokens. Everything else (the tiny seeded Llama whose pad token is EOS, the options, the
comparison of every metric both log and of the parameters after 3 plain-SGD steps) is
``differential.py``'s.

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
    drive,
    drive_tiny,
    generation_calls_note,
    record_failure,
    record_run,
    rollout_plan,
)

RLOO_BASE = dict(BASE)

#: Online DPO's options (its config has no num_generations / max_completion_length).
ONLINE_DPO_BASE = {
    **{
        k: v
        for k, v in BASE.items()
        if k not in ("num_generations", "max_completion_length", "shuffle_dataset", "log_completions")
    },
    "per_device_train_batch_size": 4,  # prompts; two completions each
    "max_new_tokens": 8,
}
#: A*-PO's options: every prompt in each step (the libraries' samplers need not agree on an order).
A2PO_BASE = {
    **ONLINE_DPO_BASE,
    "per_device_train_batch_size": len(PROMPTS),
    "max_completion_length": 8,
    "num_value_samples": 4,
}
A2PO_BASE.pop("max_new_tokens")
A2PO_BASE.pop("disable_dropout")  # not a field of the reference's A2POConfig (the tiny model has no dropout)

CONFIGS: dict[str, dict] = {
    "rloo": {},  # beta=0.05, the reference's default
    "rloo_beta_0": {"beta": 0.0},
    "rloo_normalize_advantages": {"normalize_advantages": True},
    "rloo_reward_clip": {"reward_clip_range": (-1.0, 1.0)},
    "rloo_num_iterations_2": {"num_iterations": 2, "epsilon": 0.05},
    "rloo_epsilon_high": {"num_iterations": 2, "epsilon": 0.05, "epsilon_high": 0.1},
    "rloo_mask_truncated": {"mask_truncated_completions": True},
    "rloo_reward_weights": {"reward_weights": [1.0, -0.5]},
    "rloo_temperature": {"temperature": 0.7},
    "online_dpo": {},  # sigmoid, beta 0.1
    "online_dpo_ipo": {"loss_type": "ipo"},
    "online_dpo_beta": {"beta": 0.5},
    "online_dpo_missing_eos_penalty": {"missing_eos_penalty": 1.0},
    "a2po": {},  # beta1 0.5, beta2 1e-3
    "a2po_beta2": {"beta2": 0.05, "beta1": 1.0},
    "a2po_keep_unsolved": {"filter_all_incorrect": False},
    # on a vision-language model (differential_vlm.py's tiny LLaVA-NeXT and Qwen2-VL, its eight
    # prompts with an image block and one image each); the reference's online DPO cannot run
    # Qwen2-VL on transformers 5 (its forward gets no mm_token_type_ids): that row is not compared
    "online_dpo_vlm_llava_next": {},
    "online_dpo_vlm_llava_next_ipo": {"loss_type": "ipo"},
    "online_dpo_vlm_qwen2_vl": {},
    "rloo_vlm_qwen2_vl": {},
    "rloo_vlm_llava_next": {},
    "rloo_vlm_qwen2_vl_beta_0": {"beta": 0.0},
}


def even_length_reward(prompts, completions, **kwargs):
    """A*-PO's binary reward, from the completion's text."""
    return [float(len(c) % 2 == 0) for c in completions]


def spread_reward(completion_ids, **kwargs):
    """Few ties between two completions of one prompt (online DPO picks the better one)."""
    return [0.01 * sum(ids) + 0.1 * len(ids) for ids in completion_ids]


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def length_reward(completion_ids, **kwargs):
    return [0.1 * len(ids) for ids in completion_ids]


class Script:
    """The same completions for the same rows, whichever library asks."""

    def __init__(self, tok, per_prompt: bool = False):
        self.tok, self.calls, self.per_prompt = tok, 0, per_prompt
        self.asked: dict[tuple[int, ...], int] = {}

    def completions(self, prompts: list[list[int]]) -> list[list[int]]:
        """One completion per row: a function of the prompt, its occurrence in this call and the call
        number; or (``per_prompt``) of the prompt and how often it was asked for over the run, so that
        two libraries that batch their generation calls differently still get the same completions."""
        eos, specials = self.tok.eos_token_id, set(self.tok.all_special_ids)
        seen: dict[tuple[int, ...], int] = {}
        out = []
        for ids in prompts:
            key = tuple(ids)
            text = self.tok.decode(list(ids))
            if self.per_prompt:
                n = self.asked.get(key, 0)
                self.asked[key] = n + 1
                index, call = n % 4, n // 4
            else:
                index, call = seen.get(key, 0), self.calls
                seen[key] = index + 1
            out.append(rollout_plan(text, index, call, len(self.tok), specials, eos)[0])
        self.calls += 1
        return out


def scripted_generate(script):
    """A ``model.generate`` that returns ``[prompt | scripted completion]`` rows (right padded),
    ``num_return_sequences`` per prompt, as the reference's A*-PO reads them."""
    import torch

    def generate(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        n = getattr(generation_config, "num_return_sequences", None) or 1
        ids, mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
        rows = [
            [t for t, m in zip(r, k, strict=True) if m]
            for r, k in zip(ids.tolist(), mask.tolist(), strict=True)
        ]
        done = script.completions(rows)
        width = max(len(c) for c in done)
        tail = torch.tensor(
            [c + [script.tok.pad_token_id] * (width - len(c)) for c in done], device=ids.device
        )
        return torch.cat([ids, tail], dim=1)

    return generate


def scripted_online_dpo(generate, script):
    """The reference's online DPO ``_generate`` with its sampled completions replaced by the script's
    (right padded, the mask 1 through the EOS, as its own truncation leaves them)."""
    import torch

    def scripted(model, prompts, images=None):
        prompt_ids, prompt_mask, _, _, vision = generate(model, prompts, images)
        rows = [
            [t for t, m in zip(r, k, strict=True) if m]
            for r, k in zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True)
        ]
        done = script.completions(rows)
        width = max(len(c) for c in done)
        pad = script.tok.pad_token_id
        ids = torch.tensor([c + [pad] * (width - len(c)) for c in done], device=prompt_ids.device)
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in done], device=prompt_ids.device)
        return prompt_ids, prompt_mask, ids, mask, vision

    return scripted


def script_posttrain(trainer, script) -> None:
    """Replace posttrain's generator (``trainer.generator``, the sampler's too) by one whose
    ``generate`` returns the script's completions as ``Samples``."""
    from posttrain.generation.base import Samples

    class Scripted:
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            prompts = [
                [t for t, m in zip(row, mask, strict=True) if m]
                for row, mask in zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True)
            ]
            return Samples.from_lists(script.completions(prompts), script.tok.pad_token_id, prompt_ids.device)

    trainer.generator = trainer.sampler.generator = Scripted()


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    online_dpo, a2po = name.startswith("online_dpo"), name.startswith("a2po")
    if lib == "trl" and a2po:
        from trl.experimental.a2po import A2POConfig as Config
        from trl.experimental.a2po import A2POTrainer as Trainer
    elif a2po:
        from posttrain import A2POConfig as Config
        from posttrain import A2POTrainer as Trainer
    elif lib == "trl" and online_dpo:
        from trl.experimental.online_dpo import OnlineDPOConfig as Config
        from trl.experimental.online_dpo import OnlineDPOTrainer as Trainer
    elif lib == "trl":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    elif online_dpo:
        from posttrain import OnlineDPOConfig as Config
        from posttrain import OnlineDPOTrainer as Trainer
    else:
        from posttrain import RLOOConfig as Config
        from posttrain import RLOOTrainer as Trainer
    family = vlm_family(name)
    processor = None
    if family is not None:
        from differential_vlm import dataset as vlm_dataset
        from differential_vlm import load_processor
        from transformers import AutoModelForImageTextToText

        processor = load_processor(family, model_dir)
        script = Script(processor.tokenizer)
        train_dataset = vlm_dataset("blocks")
        # the reference's online DPO loads a path with AutoModelForCausalLM, which has no VLM class: both get the model
        model_dir = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    else:
        script = Script(AutoTokenizer.from_pretrained(model_dir), per_prompt=a2po)
        train_dataset = Dataset.from_dict({"prompt": PROMPTS})
    result: dict = {"lib": lib, "config": name}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base = A2PO_BASE if a2po else ONLINE_DPO_BASE if online_dpo else RLOO_BASE
            args = Config(output_dir=tmp, **{**base, **CONFIGS[name]})
            rewards = (
                [even_length_reward]
                if a2po
                else [spread_reward]
                if online_dpo
                else [token_sum_reward, length_reward]
            )
            trainer = Trainer(
                model=model_dir,
                reward_funcs=rewards,
                args=args,
                train_dataset=train_dataset,
                # the reference's online DPO needs the tokenizer (or processor) given (it pads left itself); the
                # others load it
                **({"processing_class": processor or script.tok} if online_dpo or processor else {}),
            )
            if lib == "trl" and a2po:  # both stages call generate on the policy or the reference
                for model in (trainer.model, trainer.ref_model):
                    model.generate = scripted_generate(script)
            elif lib == "trl" and online_dpo:
                trainer._generate = scripted_online_dpo(trainer._generate, script)
            elif lib == "trl":
                trainer._generate_single_turn = lambda prompt_ids, images, fields: script.completions(
                    prompt_ids
                )
            else:
                script_posttrain(trainer, script)
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        result["calls"] = script.calls
        record_run(out_path, result, trainer)


def vlm_family(name: str) -> str | None:
    """The vision-language family of an ``online_dpo_vlm_*`` or ``rloo_vlm_*`` configuration, else ``None``."""
    if "_vlm_" not in name:
        return None
    rest = name.split("_vlm_", 1)[1]
    return next(f for f in ("qwen2_vl", "llava_next") if rest.startswith(f))


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    script = os.path.abspath(__file__)
    text = [n for n in names if vlm_family(n) is None]
    vlm = [n for n in names if vlm_family(n) is not None]
    if text:
        drive_tiny(text, keep, verbose, script, "differential-online-", generation_calls_note)
    if vlm:
        from differential_vlm import prepare_family

        work = keep or tempfile.mkdtemp(prefix="differential-online-vlm-")
        built = {f: prepare_family(work, f) for f in dict.fromkeys(vlm_family(n) for n in vlm)}

        def child_args(lib: str, name: str, out: str) -> list[str]:
            model_dir = built[vlm_family(name)][0]
            return [script, "--lib", lib, "--config", name, "--model_dir", model_dir, "--out", out]

        init = lambda name: built[vlm_family(name)][1]  # noqa: E731
        drive(vlm, work, child_args, init, generation_calls_note, verbose)
    return 0


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
