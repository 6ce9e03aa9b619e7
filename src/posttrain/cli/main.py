"""The ``posttrain`` command.

``posttrain grpo`` takes every ``GRPOConfig`` field as a flag (transformers'
``HfArgumentParser``) plus the script arguments below. With no arguments it trains the
embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, and saves the result.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

# Settings of the no-argument run: small enough for a laptop CPU, still a real GRPO job.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "grpo-smollm2-arithmetic",
    "max_steps": 50,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 96,
    "learning_rate": 5e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


@dataclass
class GRPOScriptArguments:
    """What to train on, besides the ``GRPOConfig`` flags.

    Attributes:
        model_name_or_path: hub id, local folder, or an embedded name.
        task: a built-in task (``arithmetic``) used when no ``dataset_name`` is given.
        task_size: number of prompts the built-in task generates.
        task_seed: seed of the built-in task.
        dataset_name: a dataset for ``datasets.load_dataset`` (a hub id or a local path) with a
            ``prompt`` column, instead of the built-in task.
        dataset_config: the dataset's configuration name.
        dataset_split: the split to train on.
        reward_funcs: names of built-in reward functions.
    """

    model_name_or_path: str = field(
        default="smollm2-135m-instruct", metadata={"help": "Hub id, local folder, or embedded model name."}
    )
    task: str = field(
        default="arithmetic", metadata={"help": "Built-in task used when no dataset_name is given."}
    )
    task_size: int = field(default=1000, metadata={"help": "Number of prompts the built-in task generates."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the built-in task."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset for datasets.load_dataset (hub id or local path)."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["answer_accuracy_reward", "answer_format_reward"],
        metadata={"help": "Built-in reward functions, by name."},
    )


def _reward_registry() -> dict[str, Any]:
    from posttrain.rewards import answer

    return {
        "answer_accuracy_reward": answer.answer_accuracy_reward,
        "answer_format_reward": answer.answer_format_reward,
    }


def _dataset(script: GRPOScriptArguments) -> Any:
    if script.dataset_name is None:
        from posttrain.data.tasks import load_task

        return load_task(script.task, n=script.task_size, seed=script.task_seed)
    from datasets import load_dataset

    return load_dataset(script.dataset_name, script.dataset_config, split=script.dataset_split)


def _reward_funcs(names: list[str]) -> list[Any]:
    registry = _reward_registry()
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise SystemExit(f"posttrain grpo: unknown reward function(s) {unknown}; known: {sorted(registry)}.")
    return [registry[n] for n in names]


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of ``argv``."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise SystemExit("posttrain grpo: --config needs a YAML file path.")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def _yaml_defaults(path: str, known: set[str]) -> dict[str, Any]:
    """Read a YAML recipe; its keys must be flags of ``posttrain grpo``."""
    import yaml

    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise SystemExit(f"posttrain grpo: {path} must hold a mapping of GRPOConfig fields.")
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"posttrain grpo: {path} has keys that are not flags of posttrain grpo: {unknown}.")
    return values


def grpo(argv: list[str]) -> Any:
    """Parse ``argv``, run GRPO training, save the model; returns the trainer.

    ``--config recipe.yaml`` sets defaults from a YAML file; flags on the command line win.
    """
    from transformers import HfArgumentParser

    from posttrain import GRPOConfig, GRPOTrainer

    parser = HfArgumentParser((GRPOScriptArguments, GRPOConfig), prog="posttrain grpo")
    parser.set_defaults(**LAPTOP_DEFAULTS)
    config_path, argv = _split_config(argv)
    if config_path is not None:
        known = {action.dest for action in parser._actions}
        parser.set_defaults(**_yaml_defaults(config_path, known))
    script, config = parser.parse_args_into_dataclasses(args=argv)
    funcs = _reward_funcs(script.reward_funcs)
    dataset = _dataset(script)
    trainer = GRPOTrainer(
        model=script.model_name_or_path, reward_funcs=funcs, args=config, train_dataset=dataset
    )
    trainer.train()
    trainer.save_model(config.output_dir)
    print(f"posttrain grpo: saved the trained model to {config.output_dir}")
    return trainer


COMMANDS = {"grpo": grpo}

USAGE = """usage: posttrain COMMAND [FLAGS]

commands:
  grpo    train with GRPO (every GRPOConfig field is a flag; `posttrain grpo --help` lists them;
          `--config recipe.yaml` reads defaults from a YAML file, flags win).
          With no flags: the embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU.
"""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posttrain`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"posttrain: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    command(argv[1:])


if __name__ == "__main__":
    main()
