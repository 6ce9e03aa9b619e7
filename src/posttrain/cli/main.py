"""The ``posttrain`` command.

``posttrain grpo`` takes every ``GRPOConfig`` field as a flag (transformers'
``HfArgumentParser``) plus the script arguments below. With no arguments it trains the
embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, and saves the result.

``posttrain env`` prints the versions and hardware to paste into a bug report.

Bad input (an unknown flag, a broken recipe, a reward that cannot be found, a missing dataset,
a dataset without a ``prompt`` column, an invalid setting) stops the command before training
with a one-paragraph message on stderr and exit code 2. Commands signal such input by raising
:class:`CLIError`; configuration-time ``ValueError``, ``OSError`` and ``ImportError`` of
``posttrain grpo`` are turned into one. Errors raised while training propagate unchanged.

Every command also runs as ``python -m posttrain.cli.main COMMAND ...``, hence under
``torchrun`` and ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Settings of the no-argument run: small enough for a laptop CPU, still a real GRPO job.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "grpo-smollm2-arithmetic",
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 64,
    "learning_rate": 1e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}

#: Reward functions used when ``--reward_funcs`` is not given and there is no reward model.
DEFAULT_REWARD_FUNCS: tuple[str, ...] = ("answer_accuracy_reward", "answer_format_reward")

#: Built-in rewards that need the math-verify package.
_MATH_REWARDS = frozenset({"accuracy_reward", "reasoning_accuracy_reward"})

#: Local data file suffixes and the ``datasets`` builder that reads each.
DATA_FILE_BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

#: Words that mark a file of a dataset folder as belonging to a split.
_SPLIT_WORDS = frozenset({"train", "test", "validation", "valid", "val", "dev", "eval", "evaluation"})

#: Packages ``posttrain env`` reports, by distribution name.
ENV_PACKAGES: tuple[str, ...] = (
    "posttrain",
    "torch",
    "transformers",
    "datasets",
    "accelerate",
    "peft",
    "vllm",
    "deepspeed",
    "math-verify",
    "gguf",
)


class CLIError(Exception):
    """Bad input to a command: ``main`` prints the message on stderr and exits with code 2."""


@dataclass
class GRPOScriptArguments:
    """What to train on, besides the ``GRPOConfig`` flags.

    Attributes:
        model_name_or_path: hub id, local folder, or an embedded name.
        task: a built-in task (``arithmetic``) used when no ``dataset_name`` is given.
        task_size: number of prompts the built-in task generates.
        task_seed: seed of the built-in task.
        task_few_shot: worked examples shown before each problem of the built-in task.
        task_max_value: largest operand of the built-in task's problems.
        task_system_prompt: whether the built-in task's prompts start with its system message
            (which asks for the ``<answer>`` tag).
        dataset_name: a hub dataset id, or a local ``.json``/``.jsonl``/``.csv``/``.parquet``
            file or a folder of such files, with a ``prompt`` column, instead of the built-in task.
        dataset_config: the hub dataset's configuration name.
        dataset_train_split: the split to train on.
        reward_funcs: built-in reward names or dotted import paths (``pkg.mod.func`` or
            ``pkg.mod:func``); ``None``: the built-in answer rewards, or none when a reward model
            is given.
        reward_model_name_or_path: a sequence-classification reward model (hub id or folder)
            appended to the reward functions.
    """

    model_name_or_path: str = field(
        default="smollm2-135m-instruct", metadata={"help": "Hub id, local folder, or embedded model name."}
    )
    task: str = field(
        default="arithmetic", metadata={"help": "Built-in task used when no dataset_name is given."}
    )
    task_size: int = field(default=1000, metadata={"help": "Number of prompts the built-in task generates."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the built-in task."})
    task_few_shot: int = field(
        default=1, metadata={"help": "Worked examples shown before each problem of the built-in task."}
    )
    task_max_value: int = field(default=20, metadata={"help": "Largest operand of the built-in task."})
    task_system_prompt: bool = field(
        default=False,
        metadata={
            "help": "Start the built-in task's prompts with its system message (asks for the answer tag)."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of such files "
            "(needs a 'prompt' column). Default: the built-in task."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of a hub dataset."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: built-in names or dotted import paths (my_pkg.rewards.my_reward or "
            "my_pkg.rewards:my_reward). Default: answer_accuracy_reward answer_format_reward, or none "
            "when --reward_model_name_or_path is given."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Sequence-classification reward model (hub id or folder) appended to the reward functions."
        },
    )


# ---- rewards ---------------------------------------------------------------------------------


def _reward_registry() -> dict[str, Any]:
    from posttrain import rewards

    return {
        "answer_accuracy_reward": rewards.answer_accuracy_reward,
        "answer_format_reward": rewards.answer_format_reward,
        "accuracy_reward": rewards.accuracy_reward,
        "reasoning_accuracy_reward": rewards.reasoning_accuracy_reward,
        "think_format_reward": rewards.think_format_reward,
    }


def _import_reward(path: str) -> Callable[..., Any]:
    """The callable at ``pkg.mod.func`` or ``pkg.mod:func`` (attributes may be nested after ``:``)."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise CLIError(
            f"reward function {path!r} is not a valid import path; write it as my_pkg.rewards.my_reward "
            "or my_pkg.rewards:my_reward."
        )
    # The console script does not put the working directory on sys.path, `python -m` does:
    # make a module next to the user importable either way (last, so it shadows nothing).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CLIError(f"cannot import reward function {path!r}: {exc}.") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CLIError(
                f"cannot import reward function {path!r}: module {module_name!r} has no attribute {attr!r}."
            ) from None
    if not callable(obj):
        raise CLIError(f"reward function {path!r} is a {type(obj).__name__}, not a callable.")
    return obj


def _resolve_reward(name: str, registry: dict[str, Any]) -> Callable[..., Any]:
    if name in registry:
        if name in _MATH_REWARDS and importlib.util.find_spec("math_verify") is None:
            raise CLIError(
                f"reward function {name!r} needs the math-verify package; install it with "
                "pip install 'posttrain[math]'."
            )
        return registry[name]
    if "." in name or ":" in name:
        return _import_reward(name)
    raise CLIError(
        f"unknown reward function {name!r}: it is not a built-in reward ({', '.join(sorted(registry))}) "
        "nor a dotted import path such as my_pkg.rewards.my_reward or my_pkg.rewards:my_reward."
    )


def _reward_funcs(names: list[str] | None, reward_model: str | None = None) -> list[Any]:
    """Reward callables for ``names``, then the reward model's name or path (the trainer loads it)."""
    if names is None:
        names = [] if reward_model else list(DEFAULT_REWARD_FUNCS)
    registry = _reward_registry()
    funcs: list[Any] = [_resolve_reward(name, registry) for name in names]
    if reward_model:
        funcs.append(reward_model)
    if not funcs:
        raise CLIError("no reward: give --reward_funcs, --reward_model_name_or_path, or both.")
    return funcs


# ---- datasets --------------------------------------------------------------------------------


def _looks_local(name: str) -> bool:
    """Whether a dataset name is meant as a local path rather than a hub id."""
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith((".", "/", "~"))
        or Path(name).suffix.lower() in DATA_FILE_BUILDERS
    )


def _split_files(folder: Path, files: list[Path], split: str) -> list[Path]:
    """The files of ``folder`` holding ``split``: those whose relative path names it as a word.

    When no file names any split (``data-0.jsonl``, ``part1.csv``), every file is the train split.
    """

    def words(path: Path) -> set[str]:
        return set(re.split(r"[^a-z0-9]+", str(path.relative_to(folder)).lower()))

    chosen = [f for f in files if split.lower() in words(f)]
    if chosen:
        return chosen
    if split == "train" and not any(words(f) & _SPLIT_WORDS for f in files):
        return files
    named = sorted({w for f in files for w in words(f) & _SPLIT_WORDS})
    raise CLIError(
        f"no file in the dataset folder {str(folder)!r} belongs to the split {split!r} (a file belongs to a "
        f"split when its path names it, e.g. {split}.jsonl); the files name the splits {named}. Choose one "
        "with --dataset_train_split."
    )


def _load_local_dataset(name: str, split: str) -> Any:
    """A local data file, or the ``split`` files of a folder, read with ``datasets.load_dataset``."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    path = Path(os.path.expanduser(name))
    suffixes = "/".join(DATA_FILE_BUILDERS)
    if path.is_file():
        if path.suffix.lower() not in DATA_FILE_BUILDERS:
            raise CLIError(f"dataset file {name!r} is not a {suffixes} file.")
        files = [path]
    elif path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in DATA_FILE_BUILDERS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not found:
            raise CLIError(f"dataset folder {name!r} holds no {suffixes} files.")
        files = _split_files(path, found, split)
    else:
        raise CLIError(
            f"dataset {name!r} does not exist: pass a hub dataset id, or an existing {suffixes} file or a "
            "folder of such files."
        )
    builders = {DATA_FILE_BUILDERS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise CLIError(
            f"dataset {name!r} mixes file formats ({', '.join(sorted(builders))}); use files of one format."
        )
    try:
        return load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
    except DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        raise CLIError(f"cannot read the dataset {name!r}: {cause}") from exc


def _dataset(script: GRPOScriptArguments) -> Any:
    if script.dataset_name is None:
        from posttrain.data.tasks import ARITHMETIC_SYSTEM_PROMPT, load_task

        return load_task(
            script.task,
            n=script.task_size,
            seed=script.task_seed,
            few_shot=script.task_few_shot,
            max_value=script.task_max_value,
            system_prompt=ARITHMETIC_SYSTEM_PROMPT if script.task_system_prompt else None,
        )
    if _looks_local(script.dataset_name):
        return _load_local_dataset(script.dataset_name, script.dataset_train_split)
    from datasets import load_dataset

    return load_dataset(script.dataset_name, script.dataset_config, split=script.dataset_train_split)


# ---- recipes and flags -----------------------------------------------------------------------


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of ``argv``."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise CLIError("--config needs the path of a YAML recipe file.")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _yaml_defaults(path: str, known: set[str]) -> dict[str, Any]:
    """Read a YAML recipe; its keys must be flags of ``posttrain grpo``."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise CLIError(f"cannot read the recipe file {path!r}: {exc.strerror or exc}.") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CLIError(f"the recipe file {path!r} is not valid YAML{where}: {problem}.") from exc
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise CLIError(
            f"the recipe file {path!r} must hold a mapping of flag names to values (such as "
            f"'learning_rate: 1.0e-6'), not a {type(values).__name__}."
        )
    unknown = sorted(str(k) for k in set(values) - known)
    if unknown:
        hints = "".join(_did_you_mean(k, sorted(known)) for k in unknown[:1])
        raise CLIError(
            f"the recipe file {path!r} has keys that are not flags of posttrain grpo: {unknown}{hints}; "
            "`posttrain grpo --help` lists them."
        )
    return values


def _check_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Name the flags of ``argv`` the parser does not know (HfArgumentParser raises ValueError)."""
    _, remaining = parser.parse_known_args(argv)
    if not remaining:
        return
    options = sorted(parser._option_string_actions)
    flags = [arg.split("=", 1)[0] for arg in remaining if arg.startswith("-")]
    if flags:
        named = ", ".join(f"{flag}{_did_you_mean(flag, options)}" for flag in flags)
        raise CLIError(f"unknown flag(s): {named}. `posttrain grpo --help` lists every flag.")
    raise CLIError(
        f"unexpected argument(s) {remaining}: every setting is a flag such as --max_steps 10. "
        "`posttrain grpo --help` lists them."
    )


def _one_paragraph(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _resume(value: Any) -> Any:
    """``--resume_from_checkpoint true`` resumes from the newest complete checkpoint."""
    if isinstance(value, str) and value.lower() == "true":
        return True
    return value


# ---- accelerate launch -----------------------------------------------------------------------

#: Folder of the accelerate config files shipped with posttrain (``--accelerate_config NAME``).
ACCELERATE_CONFIGS_DIR = Path(__file__).resolve().parent / "accelerate_configs"

#: Set in the relaunched processes' environment, so that they never relaunch again.
RELAUNCHED_ENV = "POSTTRAIN_ACCELERATE_LAUNCHED"

#: Environment variables that mark a process started by ``accelerate launch`` (every launcher
#: sets ``ACCELERATE_MIXED_PRECISION``), ``torchrun`` (``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``)
#: or by ``posttrain`` itself.
_LAUNCH_MARKERS: tuple[str, ...] = (
    RELAUNCHED_ENV,
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
    "ACCELERATE_MIXED_PRECISION",
)

#: Launcher flags of ``posttrain grpo``; none is a GRPOConfig field (``accelerator_config`` is).
_LAUNCHER_FLAGS: tuple[str, ...] = (
    "--accelerate_config",
    "--accelerate_num_processes",
    "--accelerate_main_process_port",
    "--accelerate_mixed_precision",
)

#: Values of ``--accelerate_mixed_precision`` (accelerate launch's ``--mixed_precision``).
_MIXED_PRECISIONS: tuple[str, ...] = ("no", "fp16", "bf16")


@dataclass
class LaunchRequest:
    """The launcher flags taken out of the ``posttrain grpo`` arguments."""

    config: str | None = None
    num_processes: int | None = None
    main_process_port: int | None = None
    mixed_precision: str | None = None


def bundled_accelerate_configs() -> dict[str, Path]:
    """Name (``single``, ``zero3``, ...) -> path of each accelerate config shipped with posttrain."""
    return {p.stem: p for p in sorted(ACCELERATE_CONFIGS_DIR.glob("*.yaml"))}


def _int_flag(flag: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise CLIError(f"{flag} needs an integer of at least {minimum}, not {value!r}.")
    return number


def split_launcher_flags(argv: list[str]) -> tuple[LaunchRequest, list[str]]:
    """Take the ``--accelerate_*`` launcher flags (``--flag VALUE`` or ``--flag=VALUE``) out of ``argv``."""
    values: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag not in _LAUNCHER_FLAGS:
            rest.append(arg)
            continue
        if not eq:
            value = next(it, None)
            if value is None or value.startswith("--"):
                raise CLIError(f"{flag} needs a value.")
        values[flag] = value
    request = LaunchRequest(config=values.get("--accelerate_config"))
    if "--accelerate_num_processes" in values:
        request.num_processes = _int_flag(
            "--accelerate_num_processes", values["--accelerate_num_processes"], 1
        )
    if "--accelerate_main_process_port" in values:
        port = _int_flag("--accelerate_main_process_port", values["--accelerate_main_process_port"], 0)
        request.main_process_port = port
    if "--accelerate_mixed_precision" in values:
        precision = values["--accelerate_mixed_precision"].lower()
        if precision not in _MIXED_PRECISIONS:
            raise CLIError(
                f"--accelerate_mixed_precision must be one of {', '.join(_MIXED_PRECISIONS)}, "
                f"not {values['--accelerate_mixed_precision']!r}."
            )
        request.mixed_precision = precision
    return request, rest


def resolve_accelerate_config(name_or_path: str) -> Path:
    """The file of a bundled config name, or of a path to the user's own accelerate config."""
    bundled = bundled_accelerate_configs()
    if name_or_path in bundled:
        return bundled[name_or_path]
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        return path
    names = ", ".join(bundled)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or os.sep in name_or_path:
        raise CLIError(
            f"the accelerate config file {name_or_path!r} does not exist; pass an existing file or one of "
            f"the bundled configs: {names}."
        )
    raise CLIError(
        f"unknown accelerate config {name_or_path!r}{_did_you_mean(name_or_path, list(bundled))}; the bundled "
        f"configs are {names}, or pass the path of your own accelerate config file."
    )


def _read_accelerate_config(path: Path) -> dict[str, Any]:
    import yaml  # YAML is a superset of JSON: reads accelerate's .json configs too

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise CLIError(
            f"cannot read the accelerate config file {str(path)!r}: {_one_paragraph(exc)}"
        ) from exc
    if not isinstance(values, dict) or "distributed_type" not in values:
        raise CLIError(
            f"the accelerate config file {str(path)!r} is not an accelerate config: it needs a mapping with a "
            "distributed_type key (see `accelerate config`)."
        )
    return values


def check_accelerate_config(path: Path) -> dict[str, Any]:
    """Read the config; every backend accelerate offers (DDP, DeepSpeed ZeRO, FSDP2) is accepted."""
    return _read_accelerate_config(path)


def inside_launch(environ: Any = None) -> bool:
    """Whether this process was started by accelerate launch, torchrun, or a posttrain relaunch."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name) for name in _LAUNCH_MARKERS)


def build_launch_command(
    config_file: str | os.PathLike[str],
    grpo_argv: list[str],
    num_processes: int | None = None,
    main_process_port: int | None = None,
    distributed_type: str | None = None,
    mixed_precision: str | None = None,
) -> list[str]:
    """The ``accelerate launch`` command that reruns ``posttrain grpo grpo_argv`` under a config.

    ``grpo_argv`` must no longer hold the launcher flags. With ``distributed_type`` ``NO`` (the
    ``single`` config) and ``num_processes`` above 1 the launch adds ``--multi_gpu``, so the
    processes really run in parallel (plain DDP; on CPU with gloo). ``mixed_precision`` overrides
    the config's: transformers takes the launcher's precision as the default of training.
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
        if num_processes > 1 and str(distributed_type).upper() == "NO":
            cmd.append("--multi_gpu")
    if main_process_port is not None:
        cmd += ["--main_process_port", str(main_process_port)]
    if mixed_precision is not None:
        cmd += ["--mixed_precision", mixed_precision]
    return [*cmd, "-m", "posttrain.cli.main", "grpo", *grpo_argv]


def _relaunch(request: LaunchRequest, grpo_argv: list[str]) -> int:
    """Run ``posttrain grpo`` again under ``accelerate launch``; the launch's exit code."""
    import subprocess

    assert request.config is not None
    path = resolve_accelerate_config(request.config)
    values = check_accelerate_config(path)
    cmd = build_launch_command(
        path,
        grpo_argv,
        num_processes=request.num_processes,
        main_process_port=request.main_process_port,
        distributed_type=str(values["distributed_type"]),
        mixed_precision=request.mixed_precision,
    )
    print(f"posttrain grpo: relaunching under accelerate ({path.name}): {' '.join(cmd)}", file=sys.stderr)
    return subprocess.run(cmd, env={**os.environ, RELAUNCHED_ENV: "1"}).returncode


# ---- commands --------------------------------------------------------------------------------


def _build_grpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from transformers import HfArgumentParser

    from posttrain import GRPOConfig, GRPOTrainer

    parser = HfArgumentParser(
        (GRPOScriptArguments, GRPOConfig),
        prog="posttrain grpo",
        usage="posttrain grpo [--config RECIPE.yaml] [--FLAG VALUE ...]",
        description="Train with GRPO. `--config RECIPE.yaml` reads flag values from a YAML mapping; "
        "flags given on the command line win.",
    )
    parser.set_defaults(**LAPTOP_DEFAULTS)
    config_path, argv = _split_config(argv)
    if config_path is not None:
        known = {action.dest for action in parser._actions} - {"help"}
        parser.set_defaults(**_yaml_defaults(config_path, known))
    _check_unknown_flags(parser, argv)
    script, config = parser.parse_args_into_dataclasses(args=argv)
    funcs = _reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
    dataset = _dataset(script)
    trainer = GRPOTrainer(
        model=script.model_name_or_path, reward_funcs=funcs, args=config, train_dataset=dataset
    )
    return trainer, config


def grpo(argv: list[str]) -> Any:
    """Train with GRPO (every GRPOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, runs GRPO training and saves the model; returns the trainer. With no flags:
    the embedded SmolLM2-135M-Instruct on the built-in arithmetic task.

    ``--accelerate_config NAME_OR_PATH`` (a bundled config: ``single``, ``multi_gpu``, ... or the
    user's accelerate config file), with ``--accelerate_num_processes N`` and
    ``--accelerate_main_process_port PORT``, ``--accelerate_mixed_precision no|fp16|bf16``, reruns the command under ``accelerate launch`` and exits
    with its code, unless this process already runs under accelerate launch or torchrun (then the
    launcher flags are ignored).

    Raises:
        CLIError: bad input, found before training starts.
    """
    request, argv = split_launcher_flags(argv)
    if request.config is not None and not inside_launch():
        raise SystemExit(_relaunch(request, argv))
    try:
        trainer, config = _build_grpo(argv)
    except (ValueError, OSError, ImportError) as exc:
        raise CLIError(_one_paragraph(exc)) from exc
    trainer.train(resume_from_checkpoint=_resume(config.resume_from_checkpoint))
    trainer.save_model(config.output_dir)
    trainer.save_state()  # trainer_state.json in output_dir, for `posttrain plot` / `report`
    if trainer.is_world_process_zero():
        print(f"posttrain grpo: saved the trained model to {config.output_dir}")
    from posttrain.models.distributed import end_process_group

    end_process_group()  # a live gloo group can abort the process at exit
    return trainer


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _hardware() -> list[tuple[str, str]]:
    import platform

    rows = [("Platform", platform.platform()), ("CPU count", str(os.cpu_count()))]
    try:
        import torch
    except Exception as exc:  # a broken torch install is what a bug report needs to show
        return [*rows, ("CUDA available", f"unknown (torch cannot be imported: {_one_paragraph(exc)})")]
    if not torch.cuda.is_available():
        built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only torch"
        return [*rows, ("CUDA available", f"no ({built})"), ("GPUs", "none"), ("bf16 supported", "no GPU")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    counts = {n: names.count(n) for n in names}
    gpus = ", ".join(f"{count} x {name}" for name, count in counts.items())
    bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    return [
        *rows,
        ("CUDA available", f"yes (CUDA {torch.version.cuda})"),
        ("GPUs", gpus),
        ("bf16 supported", bf16),
    ]


def env(argv: list[str]) -> None:
    """Print versions and hardware, to paste into a bug report."""
    parser = argparse.ArgumentParser(prog="posttrain env", description=env.__doc__)
    parser.parse_args(argv)
    import platform

    rows = [("Python", platform.python_version())]
    rows += [(name, _version(name)) for name in ENV_PACKAGES]
    rows += _hardware()
    print("Copy and paste the lines below into your bug report.\n")
    for key, value in rows:
        print(f"- {key}: {value}")


# Command name -> function taking the command's arguments. The first line of the function's
# docstring is its summary in `posttrain --help`. Raise CLIError for bad input.
def plot(argv: list[str]) -> None:
    """Write PNG curves of a run (posttrain plot RUN_DIR [--out DIR])."""
    from posttrain.observe.plots import main_plot

    main_plot(argv)


def report(argv: list[str]) -> None:
    """Write one self-contained HTML page of a run (posttrain report RUN_DIR [--out FILE])."""
    from posttrain.observe.report import main_report

    main_report(argv)


COMMANDS: dict[str, Callable[[list[str]], Any]] = {
    "grpo": grpo,
    "env": env,
    "plot": plot,
    "report": report,
}


def usage() -> str:
    """The text of ``posttrain --help``, built from ``COMMANDS``."""
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: posttrain COMMAND [FLAGS]", "", "commands:"]
    for name, command in COMMANDS.items():
        summary = (command.__doc__ or "").strip().splitlines()[0] if command.__doc__ else ""
        lines.append(f"  {name.ljust(width)}  {summary}")
    lines += [
        "",
        "`posttrain COMMAND --help` lists a command's flags (`posttrain grpo --help`: every GRPOConfig field).",
        "With no flags, `posttrain grpo` trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic task.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posttrain`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        hint = _did_you_mean(argv[0], list(COMMANDS))
        print(f"posttrain: unknown command {argv[0]!r}{hint}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    try:
        command(argv[1:])
    except CLIError as exc:
        print(f"posttrain {argv[0]}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
