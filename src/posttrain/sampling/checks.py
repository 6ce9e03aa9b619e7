"""Checks and settings for the datasets of an online trainer, before any model is loaded.

An online trainer (GRPO, RLOO, ...) reads prompts from a ``"prompt"`` column and samples
``num_generations`` completions per prompt, keeping each prompt's group whole on one
generation batch. These checks say what is wrong with a dataset, or with the batch sizes
against it, before anything expensive happens.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.data import formats, vision
from posttrain.models import loading
from posttrain.sampling.pipeline import EPISODE_COLUMN


def trainer_name(args: Any) -> str:
    """The trainer a config belongs to, for messages ("RLOOConfig" -> "RLOOTrainer")."""
    name = type(args).__name__
    return f"{name.removesuffix('Config')}Trainer" if name.endswith("Config") else "GRPOTrainer"


def check_datasets(train_dataset: Any, eval_dataset: Any, args: Any, prompt_optional: bool = False) -> None:
    """Check the train dataset and every eval dataset (a dict of them is checked one by one).

    ``prompt_optional``: environments may write the prompt (``reset``), so the column may be absent.
    """
    if train_dataset is None:
        raise ValueError(f"{trainer_name(args)} needs a train_dataset with a 'prompt' column.")
    check_dataset(
        train_dataset,
        "train_dataset",
        args,
        args.num_generations,
        train=True,
        prompt_optional=prompt_optional,
    )
    if eval_dataset is None:
        return
    items = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [("", eval_dataset)]
    for key, ds in items:
        name = f"eval_dataset[{key!r}]" if key else "eval_dataset"
        check_dataset(ds, name, args, args.num_generations_eval, train=False, prompt_optional=prompt_optional)


def check_dataset(
    dataset: Any, name: str, args: Any, group: int, train: bool, prompt_optional: bool = False
) -> None:
    """Clear errors for a dataset GRPO cannot use, before any model is loaded.

    ``prompt_optional``: environments may write the prompt (``reset``), so the column may be absent.
    """
    columns = getattr(dataset, "column_names", None)
    has_prompts = columns is None or formats.PROMPT_COLUMN in columns
    if not prompt_optional:
        formats.check_prompt_column(columns, name, trainer_name(args))
    per_process = (
        args.per_device_train_batch_size * args.steps_per_generation
        if train
        else args.per_device_eval_batch_size
    )
    global_batch = per_process * args.world_size
    if global_batch % group != 0:
        which = "per_device_train_batch_size" if train else "per_device_eval_batch_size"
        raise ValueError(
            f"The global {'generation' if train else 'evaluation'} batch ({global_batch} completions) is not a "
            f"multiple of the {'num_generations' if train else 'num_generations_eval'}={group}; adjust {which} "
            "or the number of generations so every prompt's completions fit in one batch."
        )
    if not hasattr(dataset, "__len__"):
        if train and args.max_steps <= 0:
            raise ValueError(
                f"{name} is an IterableDataset, whose length is unknown; set max_steps in GRPOConfig "
                "(e.g. max_steps=1000) so the trainer knows when to stop and how to schedule the learning rate."
            )
        return
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.")
    if has_prompts:
        for i, p in enumerate(dataset[formats.PROMPT_COLUMN]):
            formats.check_prompt(p, i)
    needed = global_batch // group
    if len(dataset) < needed:
        raise ValueError(
            f"{name} has {len(dataset)} prompts but one batch needs {needed} distinct prompts "
            f"({global_batch} completions / {group} per prompt). Add prompts or lower the batch size."
        )


def check_chat_template(dataset: Any, processing_class: Any) -> None:
    """A conversational dataset needs a tokenizer with a chat template: say so before training."""
    if not hasattr(dataset, "__len__") or len(dataset) == 0 or formats.PROMPT_COLUMN not in dataset[0]:
        return
    tok = getattr(processing_class, "tokenizer", processing_class)
    if (
        formats.is_conversational(dataset[0][formats.PROMPT_COLUMN])
        and getattr(tok, "chat_template", None) is None
    ):
        raise ValueError(
            "train_dataset is conversational (its prompts are lists of messages) but the tokenizer has no chat "
            "template. Set tokenizer.chat_template (and pass it as processing_class), or use plain-text prompts."
        )


def check_vision_inputs(
    train_dataset: Any, eval_dataset: Any, model: Any, processing_class: Any, args: Any, agent: bool = False
) -> None:
    """Datasets with images need a vision-language model, its processor and a backend that takes images.

    Checked before training: each dataset's image column (``image`` / ``images``) against the
    model and the processing class, and the first row's images against its prompt's placeholders
    (every other row is checked when it is sampled). ``agent``: tools or environments sample.

    Raises:
        ValueError: an image column with a text-only model, or with a processing class that
            has no image processor; the first row's images do not match its placeholders.
        NotImplementedError: images with continuous batching, or with vLLM and tools or environments.
    """
    evals = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [("", eval_dataset)]
    named = [("train_dataset", train_dataset)] + [
        (f"eval_dataset[{k!r}]" if k else "eval_dataset", ds) for k, ds in evals if ds is not None
    ]
    for name, dataset in named:
        column = vision.image_column(getattr(dataset, "column_names", None))
        if column is None:
            continue
        _check_image_model(name, column, model, processing_class, args, agent)
        if hasattr(dataset, "__len__") and len(dataset) > 0 and formats.PROMPT_COLUMN in dataset.column_names:
            first = dataset[0]
            images = vision.row_images(first)
            prompt = vision.place_images(first[formats.PROMPT_COLUMN], images)
            vision.check_row_images(prompt, images, f"0 of {name}", vision.image_token_of(processing_class))


def _check_image_model(
    name: str, column: str, model: Any, processing_class: Any, args: Any, agent: bool
) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not loading.is_vision_model(model):
        raise ValueError(
            f"{name} has an {column!r} column, but the model is a {type(base).__name__}, a text-only model that "
            "cannot read images. Train a vision-language model (e.g. Qwen2VLForConditionalGeneration) with its "
            f"processor as processing_class, or remove the {column!r} column (dataset.remove_columns({column!r}))."
        )
    if vision.image_processor_of(processing_class) is None:
        raise ValueError(
            f"{name} has an {column!r} column, but processing_class is a {type(processing_class).__name__} without "
            f"an image processor; pass the processor of the {type(base).__name__} "
            "(AutoProcessor.from_pretrained(...)), or leave processing_class None to load it with the model."
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise NotImplementedError(
            f"{name} has images; vision-language models sample with the transformers backend or vLLM, not "
            "continuous batching for now: set use_transformers_continuous_batching=False."
        )
    if agent and getattr(args, "use_vllm", False):
        raise NotImplementedError(
            f"{name} has images and the model samples with tools or environments; their episodes with images "
            "sample with the transformers backend only for now: set use_vllm=False."
        )


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        dataset is not None and not isinstance(dataset, Mapping) and not hasattr(dataset, "__len__")
    )


def settle_streaming_options(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """With a streamed (iterable) dataset, the options a stream needs, set as the reference sets them.

    A stream is read in order and sliced per process (``data/sampling.py``): accelerate must not
    dispatch its batches from the main process, and the train stream is read by one worker, so
    ``dataloader_num_workers`` becomes 0 (with a warning); a map-style eval set keeps its workers.

    Raises:
        ValueError: ``accelerator_config.dispatch_batches=True`` was asked for with a stream.
    """
    evals = eval_dataset.values() if isinstance(eval_dataset, Mapping) else [eval_dataset]
    if is_stream(train_dataset) or any(is_stream(ds) for ds in evals):
        if args.accelerator_config.dispatch_batches:
            raise ValueError(
                "An IterableDataset is read in order by every process, so accelerate must not dispatch its batches, "
                "but accelerator_config.dispatch_batches=True; set it to False (or leave it unset)."
            )
        args.accelerator_config.dispatch_batches = False
    if is_stream(train_dataset) and args.dataloader_num_workers != 0:
        warnings.warn(
            f"dataloader_num_workers={args.dataloader_num_workers} with an IterableDataset: workers would split "
            "the stream and break the groups of num_generations completions; using 0.",
            UserWarning,
            stacklevel=3,
        )
        args.dataloader_num_workers = 0


def check_rollout_func_batches(args: Any, has_eval: bool) -> None:
    """rollout_func gets each prompt once, so each process must hold whole groups."""
    per_process = args.per_device_train_batch_size * args.steps_per_generation
    if per_process % args.num_generations != 0:
        raise ValueError(
            f"rollout_func receives each prompt of a process's batch once, so the per-process generation batch "
            f"(per_device_train_batch_size x steps_per_generation = {per_process}) must be a multiple of "
            f"num_generations={args.num_generations}; adjust per_device_train_batch_size or steps_per_generation."
        )
    if has_eval and args.per_device_eval_batch_size % args.num_generations_eval != 0:
        raise ValueError(
            f"rollout_func needs per_device_eval_batch_size={args.per_device_eval_batch_size} to be a multiple of "
            f"num_generations_eval={args.num_generations_eval}; adjust one of them."
        )


def episode_dataset(args: Any) -> Any:
    """Rows to drive episodes when the environment owns the data: ``reset`` writes each prompt."""
    from datasets import Dataset

    prompts_per_step = max(args.generation_batch_size // args.num_generations, 1)
    return Dataset.from_dict({EPISODE_COLUMN: list(range(max(args.max_steps, 1) * prompts_per_step))})
