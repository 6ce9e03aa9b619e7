"""The accuracy of a model on a task with verifiable answers: greedy completions, checked by
the task's answer reward. The default runs print it before and after training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig

from posttrain.data import chat
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.ops.padding import left_pad
from posttrain.rewards.answer import answer_accuracy_reward, answer_format_reward


@torch.no_grad()
def task_accuracy(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    max_new_tokens: int = 64,
    batch_size: int = 50,
    progress: str | None = None,
) -> dict[str, float]:
    """Greedy completions of every prompt of ``dataset``, scored against its ``solution`` column.

    Args:
        model: a causal LM (evaluated in eval mode; its mode is restored). A forward that
            accelerate wrapped in mixed precision (a trainer's ``bf16``) is set aside for the
            evaluation: the model is measured in its weights' precision, as before training.
        tokenizer: its tokenizer (pad token set).
        dataset: rows with ``prompt`` (standard or conversational) and ``solution``.
        max_new_tokens: the most tokens of a completion.
        batch_size: prompts generated at once.
        progress: a label for a progress bar over the prompts (none when ``None``).

    Returns:
        ``{"accuracy": ..., "format": ...}``: the share of right answers and of completions with an
        ``<answer>`` block.
    """
    config = _greedy_config(tokenizer, max_new_tokens)
    device = next(model.parameters()).device
    # The training sampler's fast paths (the lean loop, the fused CPU step, the prompts' common
    # opening prefilled once), greedy; a model they cannot serve (sharded, replaced generate, ...)
    # runs model.generate, with the same result; so does a stand-in that is no transformers model
    # (no ``config``).
    generator = TransformersGenerator(lambda: model, config) if hasattr(model, "config") else None
    completions: list[str] = []
    bar = _progress_bar(progress, len(dataset))
    was_training = model.training
    model.eval()
    restore_forward = _set_aside_mixed_precision(model)  # back in the finally below, whatever happens
    try:
        for start in range(0, len(dataset), batch_size):
            prompts = dataset["prompt"][start : start + batch_size]
            completions += _greedy_completions(model, tokenizer, generator, config, prompts, device)
            if bar is not None:
                bar.update(len(prompts))
    finally:
        model.train(was_training)
        restore_forward()
        if bar is not None:
            bar.close()
    return _accuracy_and_format(completions, list(dataset["solution"]))


def _set_aside_mixed_precision(model: Any) -> Callable[[], None]:
    """Run ``model``'s own forward until the returned function is called.

    A trainer with ``bf16``/``fp16`` has accelerate wrap the model's forward in an autocast when
    training starts. The evaluation sets that wrapper aside, so a model is measured in its
    weights' precision after training as before it (when it was not wrapped yet), and the
    greedy decoding keeps the fused decode step, which a wrapped forward rules out.
    """
    wrapper = model.__dict__.get("forward")
    original = model.__dict__.get("_original_forward")
    if wrapper is None or original is None:
        return lambda: None
    if getattr(original, "__func__", None) is type(model).forward and original.__self__ is model:
        del model.forward  # the class's forward again: an instance attribute would look wrapped
    else:
        model.forward = original

    def restore() -> None:
        model.forward = wrapper

    return restore


def _greedy_config(tokenizer: Any, max_new_tokens: int) -> GenerationConfig:
    """The greedy generation config of the evaluation, stopping at the tokenizer's EOS."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _progress_bar(progress: str | None, total: int) -> Any:
    """A tqdm bar labelled ``progress`` over ``total`` problems, or None without a label."""
    if progress is None:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=progress, unit="problem")


def _greedy_completions(
    model: Any, tokenizer: Any, generator: Any, config: GenerationConfig, prompts: list[Any], device: Any
) -> list[str]:
    """The decoded greedy completions of one batch of prompts."""
    ids = [
        tokenizer(chat.render_prompt(p, tokenizer, None), add_special_tokens=isinstance(p, str))["input_ids"]
        for p in prompts
    ]
    prompt_ids, mask = left_pad(ids, tokenizer.pad_token_id)
    prompt_ids, mask = prompt_ids.to(device), mask.to(device)
    if generator is not None:
        out = generator.generate(prompt_ids, mask).completion_ids
    else:
        out = model.generate(input_ids=prompt_ids, attention_mask=mask, generation_config=config)
        out = out[:, prompt_ids.shape[1] :]
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def _accuracy_and_format(completions: list[str], solutions: list[Any]) -> dict[str, float]:
    """``{"accuracy": ..., "format": ...}``: the shares of right answers and of formatted completions."""
    right = answer_accuracy_reward(completions, solutions)
    formatted = answer_format_reward(completions)
    return {
        "accuracy": sum(r or 0.0 for r in right) / max(len(right), 1),
        "format": sum(f > 0 for f in formatted) / max(len(formatted), 1),
    }
