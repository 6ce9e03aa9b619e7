"""The ``rollout_func`` adapter: completions produced by the user's own function.

``rollout_func(prompts, trainer)`` receives each prompt of the process's batch once, in order,
and returns a dict with one entry per completion (``num_generations`` per prompt, in prompt
order): ``prompt_ids``, ``completion_ids`` and ``logprobs`` (the sampler's log-probs of the
completion tokens), optionally ``logprob_token_ids`` (the token each log-prob is of), and any
other field, which is handed to the reward functions. This module checks that contract and
turns the result into a ``Rollout`` whose ``sampler_logps`` feed the importance-sampling
correction. A prompt with images comes with every content a list of blocks and each image in its
image block, as the reference hands it; the sampler adds the rows' image inputs to the rollout
(``OnlineSampler.rollout_func_vision``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.batch import Rollout
from posttrain.generation.base import Samples, build_rollout
from posttrain.ops.padding import left_pad

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
OPTIONAL = ("logprob_token_ids",)


class RolloutFuncError(ValueError):
    """The rollout_func broke its contract; the message says what was expected."""


@dataclass
class FuncRollout:
    """A checked ``rollout_func`` result: the rollout, and the extra fields for the rewards."""

    rollout: Rollout
    extra: dict[str, Any]


def unique_prompts(prompts: Sequence[Any], group_size: int) -> list[Any]:
    """The first prompt of each group of ``group_size`` consecutive rows."""
    if len(prompts) % group_size != 0:
        raise RolloutFuncError(
            f"rollout_func needs whole groups on each process, but this process holds {len(prompts)} rows for "
            f"groups of {group_size}; make per_device_train_batch_size x steps_per_generation (and "
            "per_device_eval_batch_size) multiples of num_generations (num_generations_eval)."
        )
    return list(prompts[::group_size])


def _check(result: Any, n: int, num_prompts: int, group_size: int) -> None:
    if not isinstance(result, dict):
        raise RolloutFuncError(
            f"rollout_func must return a dict with {list(REQUIRED)}; got {type(result).__name__}."
        )
    missing = [k for k in REQUIRED if k not in result]
    if missing:
        raise RolloutFuncError(
            f"rollout_func returned no {missing}; it must return {list(REQUIRED)} (one entry per completion)."
        )
    for key in (*REQUIRED, *(k for k in OPTIONAL if k in result)):
        if len(result[key]) != n:
            raise RolloutFuncError(
                f"rollout_func returned {len(result[key])} '{key}' for {num_prompts} prompts; it must return "
                f"{group_size} completions per prompt, {n} entries in prompt order."
            )
    for i, (ids, logps) in enumerate(zip(result["completion_ids"], result["logprobs"], strict=True)):
        if len(ids) != len(logps):
            raise RolloutFuncError(
                f"rollout_func completion {i} has {len(ids)} tokens but {len(logps)} logprobs; give one "
                "log-prob per completion token."
            )
    if "logprob_token_ids" in result and [list(t) for t in result["logprob_token_ids"]] != [
        list(c) for c in result["completion_ids"]
    ]:
        raise RolloutFuncError(
            "rollout_func's logprob_token_ids differ from its completion_ids: the log-probs must be those of "
            "the sampled tokens."
        )


def call_rollout_func(
    func: Callable[[list[Any], Any], dict[str, Any]],
    prompts: Sequence[Any],
    group_size: int,
    trainer: Any,
    eos_token_ids: list[int],
    pad_token_id: int,
    device: torch.device,
) -> FuncRollout:
    """Call ``func`` on the unique prompts of a batch and check its result.

    Args:
        func: the user's rollout function.
        prompts: this process's rows' prompts (each repeated ``group_size`` times).
        group_size: completions expected per prompt.
        trainer: passed to ``func``.
        eos_token_ids, pad_token_id: for masking after EOS and padding.
        device: where the tensors go.

    Returns:
        The rollout (with ``sampler_logps``) and the extra fields.

    Raises:
        RolloutFuncError: missing keys, wrong counts, or log-probs that do not match the tokens.
    """
    unique = unique_prompts(prompts, group_size)
    n = len(prompts)
    result = func(unique, trainer)
    _check(result, n, len(unique), group_size)
    prompt_ids, prompt_mask = left_pad([list(p) for p in result["prompt_ids"]], pad_token_id)
    samples = Samples.from_lists(result["completion_ids"], pad_token_id, device, logps=result["logprobs"])
    rollout = build_rollout(
        prompt_ids.to(device), prompt_mask.to(device), samples, eos_token_ids, pad_token_id
    )
    if rollout.sampler_logps is not None:
        rollout.sampler_logps = rollout.sampler_logps * rollout.completion_mask
    extra = {k: v for k, v in result.items() if k not in REQUIRED and k not in OPTIONAL}
    return FuncRollout(rollout=rollout, extra=extra)
