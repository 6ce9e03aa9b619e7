"""The relaunch of a training subcommand under ``accelerate launch``.

``posttrain <command> --accelerate_config NAME_OR_PATH`` (a bundled config: ``single``,
``multi_gpu``, ... or the user's accelerate config file), with ``--accelerate_num_processes N``,
``--accelerate_main_process_port PORT`` and ``--accelerate_mixed_precision no|fp16|bf16``,
reruns ``python -m posttrain.cli.main <command> ...`` under ``accelerate launch`` and exits with
its code, unless this process already runs under accelerate launch or torchrun (then the
launcher flags are ignored). Bad launcher flags raise :class:`CLIError`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.cli.options import CLIError, did_you_mean, one_paragraph

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

#: Launcher flags of the training commands; none is a field of a training config
#: (``TrainingArguments.accelerator_config`` is).
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
    """The launcher flags taken out of a training command's arguments."""

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


def _launcher_values(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The launcher flags' raw values by flag, and the other arguments in order."""
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
    return values, rest


def split_launcher_flags(argv: list[str]) -> tuple[LaunchRequest, list[str]]:
    """Take the ``--accelerate_*`` launcher flags (``--flag VALUE`` or ``--flag=VALUE``) out of ``argv``."""
    values, rest = _launcher_values(argv)
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
        f"unknown accelerate config {name_or_path!r}{did_you_mean(name_or_path, list(bundled))}; the bundled "
        f"configs are {names}, or pass the path of your own accelerate config file."
    )


def _read_accelerate_config(path: Path) -> dict[str, Any]:
    import yaml  # YAML is a superset of JSON: reads accelerate's .json configs too

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise CLIError(f"cannot read the accelerate config file {str(path)!r}: {one_paragraph(exc)}") from exc
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
    command_argv: list[str],
    num_processes: int | None = None,
    main_process_port: int | None = None,
    distributed_type: str | None = None,
    mixed_precision: str | None = None,
    *,
    command: str = "grpo",
) -> list[str]:
    """The ``accelerate launch`` command that reruns ``posttrain command command_argv`` under a config.

    ``command_argv`` must no longer hold the launcher flags. With ``distributed_type`` ``NO``
    (the ``single`` config) and ``num_processes`` above 1 the launch adds ``--multi_gpu``, so the
    processes really run in parallel (plain DDP; on CPU with gloo). ``mixed_precision`` overrides
    the config's: transformers takes the launcher's precision as the default of training.
    ``command`` is the subcommand to rerun (``grpo``, the default, ``sft``, ...).
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
    return [*cmd, "-m", "posttrain.cli.main", command, *command_argv]


def relaunch(command: str, request: LaunchRequest, command_argv: list[str]) -> int:
    """Run ``posttrain command command_argv`` again under ``accelerate launch``; the launch's exit code.

    Args:
        command: the subcommand to rerun (``grpo``).
        request: the launcher flags; ``request.config`` must be set.
        command_argv: the subcommand's arguments without the launcher flags.
    """
    import subprocess

    assert request.config is not None
    path = resolve_accelerate_config(request.config)
    values = check_accelerate_config(path)
    cmd = build_launch_command(
        path,
        command_argv,
        num_processes=request.num_processes,
        main_process_port=request.main_process_port,
        distributed_type=str(values["distributed_type"]),
        mixed_precision=request.mixed_precision,
        command=command,
    )
    print(
        f"posttrain {command}: relaunching under accelerate ({path.name}): {' '.join(cmd)}", file=sys.stderr
    )
    return subprocess.run(cmd, env={**os.environ, RELAUNCHED_ENV: "1"}).returncode


def relaunch_if_requested(command: str, argv: list[str]) -> list[str]:
    """Take the launcher flags out of ``argv``; with ``--accelerate_config``, relaunch and exit.

    Outside a launcher, ``--accelerate_config`` reruns ``posttrain command`` under
    ``accelerate launch`` and raises ``SystemExit`` with the launch's exit code. Inside one (or
    without the flag) the launcher flags are dropped.

    Returns:
        ``argv`` without the launcher flags.

    Raises:
        CLIError: a launcher flag without a value or with a bad one, or an unknown or unreadable
            accelerate config.
    """
    request, argv = split_launcher_flags(argv)
    if request.config is not None and not inside_launch():
        raise SystemExit(relaunch(command, request, argv))
    return argv
