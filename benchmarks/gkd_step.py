"""One library's GKD run (off-policy steps on the dataset's completions), measured; prints one JSON line.

Run by ``benchmarks/gkd_compare.py`` in a fresh process per measurement, so peak memory belongs
to one run. The same script drives posttrain and TRL (``trl.experimental.gkd``): both get the
same student folder, a teacher loaded separately from the same folder, the same ``messages``
rows and the same GKDConfig values; only the import differs.

Work per step: ``lmbda=0.0`` (every step trains on the dataset's completions, nothing is
generated), ``beta=0.5`` (the generalised JSD), the student's forward and backward and the
teacher's forward over ``batch_size`` rows of about ``length`` tokens.

The rows: one conversation (a short user question, an assistant answer of seeded words) whose
chat-template rendering is ``length`` tokens, repeated, so every step of both libraries trains
on the same rows whatever order each library's sampler draws them in.

The teacher: the same SmolLM2-135M-Instruct, loaded again (its own copy), with its final norm's
weight multiplied by ``--teacher_sharpen`` (default 1.5). SmolLM2 ties its LM head to its
embeddings, so this is the model's own distribution at temperature 1 / 1.5: the JSD between
student and teacher is then not zero at step 1 and the two libraries' losses can be compared.
The cost of a step does not depend on the teacher's weights.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time

WORDS = (
    "the student learns the teacher's distribution over every next token and the divergence "
    "measures how far the two are apart at each position of the answer"
).split()

QUESTION = "Question: explain in a long paragraph how a student model learns from a teacher model."


def conversation(tokenizer, length: int, seed: int = 0) -> list[dict[str, str]]:
    """A user question and an assistant answer whose rendered conversation has ``length`` tokens (or a few more)."""
    rng = random.Random(seed)
    prompt = [{"role": "user", "content": QUESTION}]

    def rendered(answer: str) -> int:
        text = tokenizer.apply_chat_template(
            prompt + [{"role": "assistant", "content": answer}], tokenize=False
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    words: list[str] = []
    while rendered(" ".join(words)) < length:
        words += [rng.choice(WORDS) for _ in range(8)]
    while len(words) > 1 and rendered(" ".join(words[:-1])) >= length:
        words.pop()
    return prompt + [{"role": "assistant", "content": " ".join(words)}]


def load_teacher(model: str, sharpen: float):
    """The teacher: a second copy of the model in float32, its final norm scaled by ``sharpen``."""
    import torch
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(sharpen)
    return teacher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["posttrain", "trl"], required=True)
    parser.add_argument("--model", required=True, help="folder of SmolLM2-135M-Instruct in safetensors")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--length", type=int, default=256, help="tokens of a rendered conversation")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--teacher_sharpen", type=float, default=1.5)
    parser.add_argument("--bf16", type=int, default=0, help="GKDConfig(bf16=...): autocast of both libraries")
    opts = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    if opts.library == "posttrain":
        from posttrain import GKDConfig, GKDTrainer
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

    class Recorded(GKDTrainer):
        """The library's trainer, recording the loss each compute_loss returns (unrounded)."""

        losses: list[float] = []

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            Recorded.losses.append(float(value.detach()))
            return loss

    class Clock(TrainerCallback):
        """Wall time from the end of one optimizer step to the end of the next (data preparation included)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.times = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(opts.model)
    messages = conversation(tok, opts.length)
    dataset = Dataset.from_dict({"messages": [messages] * 64})
    teacher = load_teacher(opts.model, opts.teacher_sharpen)
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(
            output_dir=out,
            max_steps=opts.steps,
            per_device_train_batch_size=opts.batch_size,
            gradient_accumulation_steps=1,
            lmbda=0.0,
            beta=0.5,
            max_length=opts.length + 64,
            max_new_tokens=opts.length,
            gradient_checkpointing=bool(opts.gradient_checkpointing),
            learning_rate=2e-5,
            bf16=bool(opts.bf16),
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        trainer = Recorded(
            model=opts.model,
            teacher_model=teacher,
            args=args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[clock],
        )
        trained = trained_tokens(trainer, opts.library, dataset[0])
        trainer.train()
    step_times = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    print(
        json.dumps(
            {
                "library": opts.library,
                "length": opts.length,
                "batch_size": opts.batch_size,
                "gradient_checkpointing": bool(opts.gradient_checkpointing),
                "bf16": bool(opts.bf16),
                "step_times": step_times,
                "losses": Recorded.losses,
                **trained,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": torch.get_num_threads(),
                "parameter_dtype": str(next(trainer.model.parameters()).dtype),
                "teacher_dtype": str(next(teacher.parameters()).dtype),
            }
        )
    )
    sys.stdout.flush()


def trained_tokens(trainer, library: str, row: dict) -> dict:
    """How the library tokenises one row: the row's tokens and the completion tokens its loss counts."""
    if library == "trl":
        batch = trainer.data_collator([row])
        labels = batch["labels"][0]
        return {
            "row_tokens": int(batch["attention_mask"].sum()),
            "loss_tokens": int((labels[1:] != -100).sum()),
            "last_loss_tokens": trainer.processing_class.convert_ids_to_tokens(
                batch["input_ids"][0][-3:].tolist()
            ),
        }
    from posttrain.data import distill as distill_data

    split = distill_data.as_prompt_completion(__import__("datasets").Dataset.from_list([row]), False)[0]
    a = trainer.args
    rollout = distill_data.dataset_rollout(
        [split], trainer._tokenizer, trainer._eos_token_ids, a.max_length, a.chat_template_kwargs,
    )  # fmt: skip
    completion = rollout.completion_ids[0][: int(rollout.completion_mask[0].sum())]
    return {
        "row_tokens": int(rollout.prompt_mask.sum() + rollout.completion_mask.sum()),
        "loss_tokens": int(rollout.completion_mask.sum()),
        "last_loss_tokens": trainer._tokenizer.convert_ids_to_tokens(completion[-3:].tolist()),
    }


if __name__ == "__main__":
    main()
