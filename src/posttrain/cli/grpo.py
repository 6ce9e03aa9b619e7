"""``posttrain grpo``: GRPO training from the command line.

Every ``GRPOConfig`` field is a flag (transformers' ``HfArgumentParser``), next to the script
arguments of :mod:`posttrain.cli.online` (shared with ``posttrain rloo``). With no arguments it
trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, prints the
greedy accuracy on held-out problems before and after, and saves the result.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.online import OnlineScriptArguments, build_online_trainer
from posttrain.cli.options import given_fields
from posttrain.cli.training import builtin_task_accuracy, run_training, with_cpu_precision

# Settings of the no-argument run: small enough for a laptop CPU, still a real GRPO job. Sampling
# at temperature 0.7 keeps the groups near the greedy answer, so the updates move what the greedy
# evaluation reads; dynamic sampling replaces the groups that are all right or all wrong; at
# 1e-5 the greedy held-out accuracy rises within 40 steps (BENCHMARKS.md, "The default run").
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "grpo-smollm2-arithmetic",
    "max_steps": 40,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 64,
    "learning_rate": 1e-5,
    "temperature": 0.7,
    "dynamic_sampling": True,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


#: The script arguments, shared with ``posttrain rloo`` (the reference's name for GRPO's).
GRPOScriptArguments = OnlineScriptArguments


def _build_grpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error.

    Dynamic sampling is a preset of the no-argument run. When the user's own batch flags leave
    it invalid (each process must hold whole groups) and the user did not ask for it, it is
    turned off with a note rather than failing on a setting the user never chose.
    """
    from posttrain import GRPOConfig, GRPOTrainer

    def build(defaults: dict[str, Any]) -> tuple[Any, Any]:
        return build_online_trainer(argv, "grpo", "Train with GRPO.", GRPOConfig, GRPOTrainer, defaults)

    defaults = with_cpu_precision("grpo", argv, LAPTOP_DEFAULTS)
    try:
        return build(defaults)
    except ValueError as error:
        if "dynamic_sampling=True" not in str(error) or "dynamic_sampling" in given_fields(argv):
            raise
        print(
            "posttrain grpo: dynamic sampling, a default of the no-argument run, is off for this run: "
            "each process's generation batch (per_device_train_batch_size x steps_per_generation) must "
            "hold whole groups of num_generations. Pass --dynamic_sampling true with a batch that does "
            "to have it.",
            flush=True,
        )
        return build({**defaults, "dynamic_sampling": False})


def grpo(argv: list[str]) -> Any:
    """Train with GRPO (every GRPOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, runs GRPO training and saves the model; returns the trainer. With no flags:
    the embedded SmolLM2-135M-Instruct on the built-in arithmetic task, with the held-out
    accuracy before and after (``--evaluate false`` skips it).

    ``--accelerate_config NAME_OR_PATH`` (a bundled config: ``single``, ``multi_gpu``, ... or the
    user's accelerate config file), with ``--accelerate_num_processes N``,
    ``--accelerate_main_process_port PORT`` and ``--accelerate_mixed_precision no|fp16|bf16``,
    reruns the command under ``accelerate launch`` and exits with its code, unless this process
    already runs under accelerate launch or torchrun (then the launcher flags are ignored).

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("grpo", argv, _build_grpo, builtin_task_accuracy)
