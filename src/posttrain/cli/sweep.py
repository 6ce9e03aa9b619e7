"""``posttrain sweep SWEEP.yaml``: several GRPO runs at once, each a LoRA adapter on one base model.

The file names the sweep's folder, the LoRA settings, the flags every run shares and each run's
own flags (any flag of ``posttrain grpo``)::

    output_dir: sweep-smollm2-arithmetic
    lora: {r: 16, lora_alpha: 32, lora_dropout: 0.05, target_modules: all-linear}
    shared: {max_steps: 40}
    runs:
      lr-1e-4: {learning_rate: 1.0e-4}
      lr-3e-4: {learning_rate: 3.0e-4}

Each run starts from ``posttrain grpo``'s no-argument settings (bf16 on a GPU-less CPU with bf16
instructions, unless the file sets a precision), then ``shared``, then its own flags; it writes to ``output_dir/<name>`` (``log.jsonl``, checkpoints, the adapter,
``accuracy.json``), and ``output_dir/sweep.json`` sums the runs up. ``posttrain report
output_dir`` compares them on one page. See docs/sweeps.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from posttrain.cli.options import CLIError, _read_recipe, one_paragraph

#: The keys of a sweep file.
SWEEP_KEYS = ("output_dir", "lora", "shared", "runs", "shared_generation")

#: The LoRA settings a sweep file's ``lora`` mapping may give (``peft.LoraConfig`` fields).
LORA_KEYS = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "init_lora_weights")

#: ``lora`` when the sweep file gives none: TRL's ModelConfig defaults, on every linear layer.
DEFAULT_LORA: dict[str, Any] = {
    "r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "target_modules": "all-linear",
}

#: Flags that must be the same for every run: what the shared base model is.
SHARED_ONLY = (
    "model_name_or_path",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
)


def read_sweep_file(path: str) -> dict[str, Any]:
    """The sweep file's mapping, checked: its keys, ``runs`` as a mapping of names to flag mappings."""
    spec = _read_recipe(path)
    if not isinstance(spec, dict):
        raise CLIError(f"the sweep file {path!r} must hold a mapping with the keys {list(SWEEP_KEYS)}.")
    unknown = sorted(str(key) for key in set(spec) - set(SWEEP_KEYS))
    if unknown:
        raise CLIError(
            f"the sweep file {path!r} has unknown keys {unknown}: it takes {list(SWEEP_KEYS)} (run flags go "
            "under 'shared' or under a run's name in 'runs')."
        )
    runs = spec.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise CLIError(
            f"the sweep file {path!r} needs 'runs': a mapping of run names to their flags, such as "
            "'runs: {lr-1e-4: {learning_rate: 1.0e-4}, lr-3e-4: {learning_rate: 3.0e-4}}'."
        )
    for name, flags in runs.items():
        if flags is not None and not isinstance(flags, dict):
            raise CLIError(
                f"run {name!r} of {path!r} must map flag names to values, not a {type(flags).__name__}."
            )
        for key in SHARED_ONLY:
            if key in (flags or {}):
                raise CLIError(
                    f"run {name!r} of {path!r} sets {key}, which every run shares (the base model and the "
                    "adapters' settings): set it under 'shared' (model) or 'lora'."
                )
    for key in ("lora", "shared"):
        if spec.get(key) is not None and not isinstance(spec[key], dict):
            raise CLIError(f"'{key}' in {path!r} must be a mapping, not a {type(spec[key]).__name__}.")
    bad = sorted(set(spec.get("lora") or {}) - set(LORA_KEYS))
    if bad:
        raise CLIError(f"'lora' in {path!r} has unknown keys {bad}; it takes {list(LORA_KEYS)}.")
    return spec


def _build(path: str, out: str | None) -> tuple[Any, dict[str, Any]]:
    """The sweep described by the file, every run's trainer built, and each run's held-out problems."""
    from posttrain import GRPOConfig
    from posttrain.cli.grpo import LAPTOP_DEFAULTS
    from posttrain.cli.online import OnlineScriptArguments, heldout_problems, training_prompts
    from posttrain.cli.options import parse_config
    from posttrain.cli.rewards import resolve_reward_funcs
    from posttrain.cli.training import announce_cpu_bf16, cpu_precision_choice
    from posttrain.models.peft import _import_peft
    from posttrain.sweep import GRPOSweep, SweepRun

    spec = read_sweep_file(path)
    output_dir = out or spec.get("output_dir") or os.path.splitext(os.path.basename(path))[0]
    shared = dict(spec.get("shared") or {})
    runs, heldout, model_name = [], {}, None
    given = set(shared).union(*(set(flags or {}) for flags in spec["runs"].values()))
    precision = cpu_precision_choice(given)  # as `posttrain grpo`'s runs, alike for every run
    if precision.get("bf16"):
        announce_cpu_bf16("sweep")
    for name, flags in spec["runs"].items():
        values = {**shared, **(flags or {}), "output_dir": os.path.join(output_dir, str(name))}
        try:
            script, config = parse_config(
                [],
                OnlineScriptArguments,
                GRPOConfig,
                command="grpo",
                summary="Train with GRPO.",
                defaults={
                    **LAPTOP_DEFAULTS,
                    **precision,
                    "disable_tqdm": True,
                },  # lines labelled by run, no bars
                values=values,
                values_source=f"run {name!r} of the sweep file {path!r}",
            )
        except ValueError as exc:
            raise CLIError(f"run {name!r}: {one_paragraph(exc)}") from exc
        model_name = script.model_name_or_path
        funcs = resolve_reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
        heldout[str(name)] = heldout_problems(script, config)
        runs.append(
            SweepRun(
                str(name),
                config,
                reward_funcs=funcs,
                train_dataset=training_prompts(script, heldout[str(name)]),
            )
        )
    lora = _import_peft().LoraConfig(task_type="CAUSAL_LM", **{**DEFAULT_LORA, **(spec.get("lora") or {})})
    shared_generation = spec.get("shared_generation", False)
    if not isinstance(shared_generation, bool):
        raise CLIError(f"'shared_generation' in {path!r} must be true or false, not {shared_generation!r}.")
    sweep = GRPOSweep(
        model_name, runs, peft_config=lora, output_dir=output_dir, shared_generation=shared_generation
    )
    return sweep, heldout


def sweep(argv: list[str]) -> Any:
    """Train several GRPO runs at once, each a LoRA adapter on one base model (SWEEP.yaml).

    Returns:
        The ``GRPOSweep``, trained.

    Raises:
        CLIError: a bad sweep file or run flag, found before any training.
    """
    parser = argparse.ArgumentParser(
        prog="posttrain sweep",
        description="Train several GRPO runs at once, each its own LoRA adapter on one shared base model. "
        "SWEEP.yaml names the sweep's folder (output_dir), the LoRA settings (lora), the flags every run "
        "shares (shared) and each run's own (runs: {name: {flag: value}}); flags are posttrain grpo's. "
        "See docs/sweeps.md.",
    )
    parser.add_argument("sweep_file", metavar="SWEEP.yaml")
    parser.add_argument(
        "--output_dir", default=None, help="the sweep's folder (default: the file's output_dir)"
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        action="store_true",
        help="resume each run from its newest complete checkpoint",
    )
    parser.add_argument(
        "--evaluate", default="true", choices=["true", "false"], help="held-out accuracy before/after"
    )
    args = parser.parse_args(argv)
    try:
        built, heldout = _build(args.sweep_file, args.output_dir)
    except (ValueError, OSError, ImportError) as exc:
        raise CLIError(one_paragraph(exc)) from exc
    return _train(built, heldout if args.evaluate == "true" else {}, args.resume_from_checkpoint)


def _train(built: Any, heldout: dict[str, Any], resume: bool) -> Any:
    """Train the sweep: compact lines labelled by run, the held-out accuracy before and after each run."""
    import json

    from posttrain.cli.training import LOG_FILE
    from posttrain.observe.console import use_compact_console
    from posttrain.rewards.evaluate import task_accuracy
    from posttrain.sweep.runner import write_summary

    for name, trainer in built.trainers.items():
        use_compact_console(trainer, os.path.join(trainer.args.output_dir, LOG_FILE), label=name)
    before: dict[str, Any] = {}
    accuracy: dict[str, dict[str, Any]] = {}

    def measure(name: str, trainer: Any) -> dict[str, float]:
        problems = heldout[name]
        return task_accuracy(
            trainer.model, trainer._tokenizer, problems.problems, max_new_tokens=problems.max_new_tokens
        )

    names_with_heldout = [name for name, problems in heldout.items() if problems is not None]
    if names_with_heldout:
        # a new adapter adds nothing (LoRA's B starts at zero): every run starts from the base model's accuracy
        first = built.trainers[names_with_heldout[0]]
        with first.model.disable_adapter():
            base = measure(names_with_heldout[0], first)
        for name in names_with_heldout:
            before[name] = base if _same_problems(heldout[name], heldout[names_with_heldout[0]]) else None

    def after_run(name: str, trainer: Any) -> None:
        if heldout.get(name) is None:
            return
        if before.get(name) is None:
            with trainer.model.disable_adapter():
                before[name] = measure(name, trainer)
        after = measure(name, trainer)
        accuracy[name] = {"before": before[name], "after": after}
        with open(os.path.join(trainer.args.output_dir, "accuracy.json"), "w") as f:
            json.dump(accuracy[name], f, indent=1)
        for metric in after:
            print(
                f"posttrain sweep [{name}]: held-out {metric} {before[name][metric]:.2f} before training, "
                f"{after[metric]:.2f} after",
                flush=True,
            )

    outcomes = built.train(resume_from_checkpoint=True if resume else None, after_run=after_run)
    write_summary(built.output_dir, outcomes, {name: {"accuracy": value} for name, value in accuracy.items()})
    for name, outcome in outcomes.items():
        tail = f": {outcome.error}" if outcome.error else ""
        print(f"posttrain sweep [{name}]: {outcome.status} at step {outcome.global_step}{tail}", flush=True)
    print(f"posttrain sweep: runs in {built.output_dir}; `posttrain report {built.output_dir}` compares them")
    return built


def _same_problems(a: Any, b: Any) -> bool:
    """Whether two runs' held-out problems (``HeldOut``) are the same rows, measured as long."""
    return a.max_new_tokens == b.max_new_tokens and a.problems.to_list() == b.problems.to_list()
