"""The flags of a training subcommand: ``--config`` recipes, unknown-flag checks, parsing.

Every ``posttrain <trainer>`` command parses its arguments with :func:`parse_config`: the
fields of a script-arguments dataclass and of the trainer's config are flags (transformers'
``HfArgumentParser``), ``--config RECIPE.yaml`` supplies defaults, and a flag the parser does
not know stops the command with a did-you-mean hint. Bad input raises :class:`CLIError`.
"""

from __future__ import annotations

import argparse
import difflib
import typing
from typing import Any


class CLIError(Exception):
    """Bad input to a command: ``main`` prints the message on stderr and exits with code 2."""


def did_you_mean(name: str, choices: list[str]) -> str:
    """`` (did you mean X?)`` for the choice closest to ``name``, or an empty string."""
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def one_paragraph(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its type name when the message is empty)."""
    return " ".join(str(exc).split()) or type(exc).__name__


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


def _read_recipe(path: str) -> Any:
    """The parsed content of a YAML recipe file."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise CLIError(f"cannot read the recipe file {path!r}: {exc.strerror or exc}.") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CLIError(f"the recipe file {path!r} is not valid YAML{where}: {problem}.") from exc


def _yaml_defaults(path: str, known: set[str], prog: str) -> dict[str, Any]:
    """Read a YAML recipe; its keys must be flags of the command ``prog`` (``posttrain grpo``)."""
    values = _read_recipe(path)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise CLIError(
            f"the recipe file {path!r} must hold a mapping of flag names to values (such as "
            f"'learning_rate: 1.0e-6'), not a {type(values).__name__}."
        )
    unknown = sorted(str(k) for k in set(values) - known)
    if unknown:
        hints = "".join(did_you_mean(k, sorted(known)) for k in unknown[:1])
        raise CLIError(
            f"the recipe file {path!r} has keys that are not flags of {prog}: {unknown}{hints}; "
            f"`{prog} --help` lists them."
        )
    return values


def given_fields(argv: list[str]) -> set[str]:
    """The fields ``argv`` sets itself: its ``--FLAG`` names and, with ``--config``, the recipe's keys.

    A command's laptop defaults are presets; this tells which of them the user replaced.
    """
    config_path, rest = _split_config(argv)
    given = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in rest if arg.startswith("--")}
    if config_path is not None:
        recipe = _read_recipe(config_path)
        if isinstance(recipe, dict):
            given |= {str(key) for key in recipe}
    return given


def _check_unknown_flags(parser: argparse.ArgumentParser, argv: list[str], prog: str) -> None:
    """Name the flags of ``argv`` the parser does not know (HfArgumentParser raises ValueError)."""
    _, remaining = parser.parse_known_args(argv)
    if not remaining:
        return
    options = sorted(parser._option_string_actions)
    flags = [arg.split("=", 1)[0] for arg in remaining if arg.startswith("-")]
    if flags:
        named = ", ".join(f"{flag}{did_you_mean(flag, options)}" for flag in flags)
        raise CLIError(f"unknown flag(s): {named}. `{prog} --help` lists every flag.")
    raise CLIError(
        f"unexpected argument(s) {remaining}: every setting is a flag such as --max_steps 10. "
        f"`{prog} --help` lists them."
    )


def _check_known(values: dict[str, Any], known: set[str], source: str, prog: str) -> None:
    """Name the keys of ``values`` that are not flags of ``prog``, with a did-you-mean hint."""
    unknown = sorted(str(k) for k in set(values) - known)
    if unknown:
        raise CLIError(
            f"{source} has keys that are not flags of {prog}: {unknown}"
            f"{did_you_mean(unknown[0], sorted(known))}; `{prog} --help` lists them."
        )


def _fixed_length_tuples(parser: argparse.ArgumentParser) -> None:
    """Flags of fields typed ``tuple[float, float]`` take that many values (``--reward_clip_range -1 1``).

    ``HfArgumentParser`` hands the one string after the flag to the tuple type, which splits it
    into characters; here the flag takes one value per tuple entry, each converted by its type.
    """
    for action in parser._actions:
        kind = action.type
        if (
            typing.get_origin(kind) is tuple
            and typing.get_args(kind)
            and Ellipsis not in typing.get_args(kind)
        ):
            entries = typing.get_args(kind)
            if len(set(entries)) == 1 and entries[0] in (int, float, str):
                action.nargs, action.type = len(entries), entries[0]


def parse_config(
    argv: list[str],
    script_args_class: type,
    config_class: type,
    *,
    command: str,
    summary: str,
    defaults: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
    values_source: str | None = None,
) -> tuple[Any, Any]:
    """Parse a training subcommand's ``argv`` into its script arguments and its training config.

    Every field of both dataclasses is a flag. ``--config RECIPE.yaml`` reads flag values from
    a YAML mapping; flags given on the command line win over it, and it wins over ``defaults``.

    Args:
        argv: the arguments after the subcommand's name, without the launcher flags.
        script_args_class: the dataclass of what to train on (model, dataset, ...).
        config_class: the trainer's config class (a ``TrainingArguments`` subclass).
        command: the subcommand's name (``grpo``); the messages name ``posttrain <command>``.
        summary: the first sentence of ``posttrain <command> --help``.
        defaults: flag values used when neither the recipe nor the command line sets them.
        values: flag values that win over the recipe and ``defaults`` (``posttrain sweep``'s
            per-run settings); each key must be a flag.
        values_source: what ``values`` came from, for the message naming an unknown key.

    Returns:
        ``(script_args, config)``, instances of ``script_args_class`` and ``config_class``.

    Raises:
        CLIError: an unreadable recipe, a recipe key or flag that is not a field, a stray
            positional argument.
        ValueError: the config's own validation (``__post_init__``) rejects a value.
    """
    from transformers import HfArgumentParser

    prog = f"posttrain {command}"
    parser = HfArgumentParser(
        (script_args_class, config_class),
        prog=prog,
        usage=f"{prog} [--config RECIPE.yaml] [--FLAG VALUE ...]",
        description=f"{summary} `--config RECIPE.yaml` reads flag values from a YAML mapping; "
        "flags given on the command line win.",
    )
    _fixed_length_tuples(parser)
    parser.set_defaults(**(defaults or {}))
    config_path, argv = _split_config(argv)
    known = {action.dest for action in parser._actions} - {"help"}
    if config_path is not None:
        parser.set_defaults(**_yaml_defaults(config_path, known, prog))
    if values:
        _check_known(values, known, values_source or "the settings", prog)
        parser.set_defaults(**values)
    _check_unknown_flags(parser, argv, prog)
    script_args, config = parser.parse_args_into_dataclasses(args=argv)
    return script_args, config
