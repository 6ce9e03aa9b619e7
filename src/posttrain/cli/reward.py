"""``posttrain reward``: reward modelling from the command line.

Every ``RewardConfig`` field is a flag, next to the :class:`RewardScriptArguments` below. With
no arguments it loads the embedded SmolLM2-135M-Instruct as a one-label sequence classifier
(a new score head on the causal LM), trains it on the built-in arithmetic preference pairs
(``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen over a
wrong result or an untagged answer), on CPU, and saves it; the saved folder is a reward model
for ``posttrain grpo --reward_model_name_or_path <output_dir>``.

A reward model does not generate, so instead of the task accuracy the command measures the
*pairwise accuracy* before and after training: the share of held-out pairs whose chosen side
scores higher than the rejected one, overall and per kind of rejected answer (a wrong result
in the tag, or the right result untagged). The held-out pairs (:func:`heldout_pairs`) are
built-in pairs drawn with a seed of their own, without the problems of the training pairs; the
figures are printed and written to ``output_dir/accuracy.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.options import parse_config
from posttrain.cli.training import TaskScriptArguments, laptop_defaults, run_training, task_dataset

#: The seed and size of the held-out pairs (the training pairs' default seed is 2).
HELDOUT_PAIRS_SEED, HELDOUT_PAIRS_SIZE = 20261202, 100

# Settings of the no-argument run: a real reward-model job that ends within minutes on a laptop
# CPU. Every weight trains (no PEFT), so the learning rate is 1e-5, not RewardConfig's 1e-4 (a
# default suited to adapters). Measured on CPU with the defaults (held-out pairwise accuracy,
# before -> after; 51 untagged and 49 wrong-result pairs): 1e-5 gives 0.73 -> 0.83 (untagged
# 1.00 -> 1.00, wrong result 0.45 -> 0.65); 1e-4 gives 0.73 -> 0.75, with the wrong-result pairs
# left at chance (0.49): it learns the answer format only.
LAPTOP_DEFAULTS: dict[str, Any] = laptop_defaults("reward", 1e-5)


@dataclass
class RewardScriptArguments(TaskScriptArguments):
    """What to train on, besides the ``RewardConfig`` flags (see ``TaskScriptArguments``).

    Attributes:
        task_seed: seed of the built-in preference pairs.
        evaluate: measure the pairwise accuracy on held-out built-in pairs before and after
            (built-in task only).
    """

    task_seed: int = field(default=2, metadata={"help": "Seed of the built-in preference pairs."})
    evaluate: bool = field(
        default=True,
        metadata={
            "help": "Print the reward model's pairwise accuracy on held-out built-in pairs before and after "
            "training (built-in task only)."
        },
    )


def heldout_pairs(
    exclude: set[str] | None = None, n: int = HELDOUT_PAIRS_SIZE, seed: int = HELDOUT_PAIRS_SEED
) -> Any:
    """Built-in arithmetic preference pairs to measure a reward model on, apart from its training pairs.

    Args:
        exclude: the problems (last prompt message) of the training pairs; pairs on them are
            left out.
        n: the most pairs to return.
        seed: the seed of the pairs, other than the training pairs'.

    Returns:
        A dataset of at most ``n`` rows with ``prompt``, ``chosen``, ``rejected``, ``solution``
        and ``kind``: ``"wrong_result"`` (the rejected answer tags a wrong result) or
        ``"untagged"`` (it gives the right result without the answer tag).

    Raises:
        ValueError: every drawn pair is on a training problem.
    """
    from posttrain.data.tasks import arithmetic_preference_dataset

    pool = arithmetic_preference_dataset(n=10 * n, seed=seed)
    exclude = exclude or set()
    keep = [i for i, prompt in enumerate(pool["prompt"]) if prompt[-1]["content"] not in exclude][:n]
    if not keep:
        raise ValueError(
            "the training pairs cover every problem of the held-out pairs, so the reward model cannot be "
            "measured on unseen ones. Lower --task_size, or pass --evaluate false."
        )
    held_out = pool.select(keep)
    return held_out.map(
        lambda row: {"kind": "wrong_result" if "<answer>" in row["rejected"][-1]["content"] else "untagged"}
    )


def heldout_pairwise_accuracy(trainer: Any) -> dict[str, float] | None:
    """The share of the trainer's held-out pairs whose chosen side the reward model scores higher.

    The pairs (``trainer.heldout_pairs``, none for a user's dataset) are tokenised as the
    trainer tokenises its training pairs, but none is dropped for its length; each is scored by
    the model in eval mode (restored afterwards), in batches of ``per_device_eval_batch_size``
    pairs, with a progress bar on the main process (unless ``disable_tqdm``). A tie counts as a
    miss, as in the trainer's ``accuracy`` metric. When the pairs have a ``kind`` column (the
    built-in ones: :func:`heldout_pairs`), the share is also given per kind, which tells a
    reward model that learnt the answer format from one that also tells right results from
    wrong ones.

    Args:
        trainer: a ``RewardTrainer``.

    Returns:
        ``{"pairwise_accuracy": ...}`` plus ``pairwise_accuracy_<kind>`` for each kind, or
        ``None`` when the trainer has no held-out pairs.
    """
    pairs = getattr(trainer, "heldout_pairs", None)
    if pairs is None:
        return None
    from posttrain.reward.trainer import prepare_reward_dataset

    tokenizer = trainer._tokenizer
    rows = prepare_reward_dataset(pairs, tokenizer, max_length=None, eos_token=trainer._eos_token)
    model = trainer.model
    device = next(model.parameters()).device
    batch_size = max(1, int(trainer.args.per_device_eval_batch_size))
    was_training = model.training
    model.eval()
    bar = None
    if trainer.is_world_process_zero() and not trainer.args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), desc="held-out pairwise accuracy", unit="pair")
    try:
        wins = _pair_wins(model, device, rows, tokenizer.pad_token_id, batch_size, bar)
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    return _pairwise_figures(wins, pairs)


def _pair_wins(
    model: Any, device: Any, rows: Any, pad_token_id: int, batch_size: int, bar: Any
) -> list[bool]:
    """Whether the model scores each pair's chosen side above its rejected one, in order."""
    import torch

    from posttrain.reward.trainer import collate_reward_pairs

    wins: list[bool] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
            stacked = collate_reward_pairs(batch, pad_token_id).pairs.stacked()
            scores = model(
                input_ids=stacked.input_ids.to(device),
                attention_mask=stacked.attention_mask.to(device),
                use_cache=False,
            ).logits[:, 0]
            n = len(batch)
            wins += (scores[:n] > scores[n:]).tolist()
            if bar is not None:
                bar.update(n)
    return wins


def _pairwise_figures(wins: list[bool], pairs: Any) -> dict[str, float]:
    """``{"pairwise_accuracy": ...}``, plus the share per kind when the pairs have a ``kind`` column."""
    figures = {"pairwise_accuracy": sum(wins) / len(wins)}
    if "kind" in pairs.column_names:
        for kind in sorted(set(pairs["kind"])):
            mine = [won for won, k in zip(wins, pairs["kind"], strict=True) if k == kind]
            figures[f"pairwise_accuracy_{kind}"] = sum(mine) / len(mine)
    return figures


def _build_reward(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import RewardConfig, RewardTrainer
    from posttrain.data.tasks import arithmetic_preference_dataset

    script, config = parse_config(
        argv,
        RewardScriptArguments,
        RewardConfig,
        command="reward",
        summary="Train a reward model (a one-label sequence classifier) on preference pairs.",
        defaults=LAPTOP_DEFAULTS,
    )
    dataset = task_dataset(script, arithmetic_preference_dataset)
    held_out = None
    if script.dataset_name is None and script.evaluate:
        held_out = heldout_pairs(exclude={prompt[-1]["content"] for prompt in dataset["prompt"]})
    trainer = RewardTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.heldout_pairs = held_out
    return trainer, config


def reward(argv: list[str]) -> Any:
    """Train a reward model on preference pairs (every RewardConfig field is a flag; --config RECIPE.yaml).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct loaded as a sequence classifier, trained on the built-in
    arithmetic preference pairs, with its pairwise accuracy on held-out pairs before and after.
    The ``--accelerate_*`` launcher flags work as for ``posttrain grpo``.

    Args:
        argv: the arguments after ``posttrain reward``.

    Returns:
        The trained ``RewardTrainer``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("reward", argv, _build_reward, heldout_pairwise_accuracy)
