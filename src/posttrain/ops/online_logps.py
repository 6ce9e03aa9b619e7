"""Log-probabilities and entropy of completion tokens: the online methods' scoring.

The model is run on ``[prompt | completion]`` and only the completion positions are scored
(``completion_logps`` -> ``PolicyOutput``), by the chunked or the naive path that
``ops/logprobs.py`` describes; where rows share a prompt, each distinct prompt runs once
(``ops/shared_prefix.py``). Also here: a sampler's own report (``sampler_topk``,
``sampler_topk_truncated``) and the completion positions' hidden states and head for
distillation (``completion_head_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops import checkpointing, chunked, shared_prefix, support, topk
from posttrain.ops.divergence import HeadInputs
from posttrain.ops.sequence_stats import (
    entropy_from_logits,
    selective_log_softmax,
)
from posttrain.ops.tied_embedding import tied_embedding_grad


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` uses them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


@dataclass
class PolicyOutput:
    """What one forward pass of the policy on ``[prompt | completion]`` yields.

    Attributes:
        logps: [B, T] log-probs of the completion tokens.
        entropy: [B, T] per-token entropy, or ``None`` when not asked for; it carries a
            gradient only when asked with ``entropy_grad=True``.
        aux_loss: the router load-balancing loss of a Mixture-of-Experts model, if it reports one.
        extra_logps: [B, T, K] log-probs of the ``extra_ids`` asked for at each position (with
            gradient), or ``None``.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    extra_logps: torch.Tensor | None = None


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
    share_prompts: bool = True,
    extra_ids: torch.Tensor | None = None,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> PolicyOutput:
    """Log-probs (and optionally entropy) of each completion token under ``model``.

    Args:
        model: a causal LM accepting ``logits_to_keep`` (possibly a ``PeftModel`` or DDP-wrapped).
        prompt_ids: [B, P] left-padded prompts; prompt_mask: [B, P].
        completion_ids: [B, T] right-padded completions; completion_mask: [B, T].
        temperature: sampling temperature the logits are divided by.
        with_entropy: also compute the per-token entropy.
        entropy_grad: let the entropy carry a gradient (entropy regularisation).
        chunk_size: token rows projected onto the vocabulary at once by the chunked path;
            ``None`` forces the naive full-logits path.
        share_prompts: on the chunked path, run each distinct prompt through the model once for
            all the rows that share it (``ops/shared_prefix.py``), where the model supports it.
        extra_ids: [B, T, K] more token ids whose log-probs are wanted at each completion position
            (score centering's sampler top-k); they share the completion tokens' projection.
        model_inputs: a vision-language model's other inputs for the ``[prompt | completion]``
            rows (``core.batch.Rollout.vision_kwargs``: pixel values, grid sizes, token types);
            the rows are then run whole (no shared prompt pass).

    Returns:
        A ``PolicyOutput``.
    """
    targets = (
        completion_ids if extra_ids is None else torch.cat([completion_ids.unsqueeze(-1), extra_ids], -1)
    )
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs, found = rows_and_hidden(model, *rows, model_inputs, share_prompts, chunk_size is not None)
    if found is not None:
        out, predicting = found
        result = _stats_output(
            model, out, predicting, targets, temperature, with_entropy, entropy_grad, chunk_size
        )
        return _split_extra(result, extra_ids is not None)
    result = _naive_output(model, inputs, targets, temperature, with_entropy, entropy_grad)
    return _split_extra(result, extra_ids is not None)


def _split_extra(result: PolicyOutput, extra: bool) -> PolicyOutput:
    """[B, T, 1 + K] log-probs -> the completion tokens' [B, T] and the extra ids' [B, T, K]."""
    if not extra:
        return result
    result.extra_logps = result.logps[..., 1:]
    result.logps = result.logps[..., 0]
    return result


@torch.no_grad()
def sampler_topk(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    k: int,
    chunk_size: int = chunked.DEFAULT_CHUNK_SIZE,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a sampler reports of its completions: each token's log-prob and its top-``k`` tokens.

    One teacher-forced pass of the sampling model, without gradient, projected onto the
    vocabulary ``chunk_size`` positions at a time; a vision-language model's ``model_inputs``
    (``Rollout.vision_kwargs``) go to the forward.

    Returns:
        ``(logps [B, T], top_logps [B, T, k], top_ids [B, T, k])`` in float32.
    """
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs, found = rows_and_hidden(model, *rows, model_inputs, share_prompts=True)
    if found is not None:
        head = chunked.causal_lm(model).get_output_embeddings()
        return topk.token_topk(
            chunked.head_input(model, found[1]),
            head.weight,
            head.bias,
            completion_ids,
            temperature,
            k,
            chunk_size,
        )
    T = completion_ids.shape[1]
    logits = model(**inputs, logits_to_keep=T + 1).logits[:, :-1, :].float() / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    top = logp_all.topk(k, dim=-1)
    return logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), top.values, top.indices


def sampler_topk_truncated(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    k: int,
    truncation: Any,
    chunk_size: int = chunked.DEFAULT_CHUNK_SIZE,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sampler_topk`` for a sampler with top-k / top-p / min-p (``ops/support.Truncation``).

    The support of each position is the sampler's filters applied to its own teacher-forced scores
    (the drawn token always in it); the log-probs are the softmax restricted to it. ``model_inputs``:
    as ``sampler_topk``.

    Returns:
        ``(logps [B, T], top_logps [B, T, k], top_ids [B, T, k], support [B, T, M])``; top slots
        past a support's size have log-prob ``-inf``, support ids past it are ``-1``.
    """
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs, found = rows_and_hidden(model, *rows, model_inputs, share_prompts=True)
    if found is not None:
        head = chunked.causal_lm(model).get_output_embeddings()
        return topk.token_topk_truncated(
            chunked.head_input(model, found[1]), head.weight, head.bias, completion_ids, temperature, k,
            truncation, chunk_size,
        )  # fmt: skip
    B, T = completion_ids.shape
    logits = model(**inputs, logits_to_keep=T + 1).logits[:, :-1, :].float() / temperature  # [B, T, V]
    logps, top_logps, top_ids, ids = support.truncated_topk(
        logits.reshape(B * T, -1), completion_ids.reshape(-1), k, truncation
    )
    kk = top_ids.shape[-1]
    return logps.view(B, T), top_logps.view(B, T, kk), top_ids.view(B, T, kk), ids.view(B, T, -1)


def completion_head_inputs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool = True,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> tuple[HeadInputs, Any]:
    """What ``model``'s LM head turns into the logits of each completion position (distillation).

    One forward of ``[prompt | completion]`` rows (each distinct prompt once where supported), with
    gradient if the caller has one. On the chunked path: the [B, T, H] hidden states that predict
    the completion tokens, with the head's weight and bias, so the vocabulary projection can be
    chunked (``ops/divergence.py``); otherwise the model's own [B, T, V] logits. A vision-language
    model's ``model_inputs`` (``Rollout.vision_kwargs``) go to the forward, the rows then whole.

    Returns:
        ``(HeadInputs, aux_loss)``: ``aux_loss`` is a Mixture-of-Experts model's router loss, or ``None``.
    """
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs, found = rows_and_hidden(model, *rows, model_inputs, share_prompts)
    if found is not None:
        out, predicting = found
        head = chunked.causal_lm(model).get_output_embeddings()
        dtype = chunked.head_product_dtype(model)
        side = HeadInputs(chunked.head_input(model, predicting), head.weight, head.bias, dtype)
        return side, getattr(out, "aux_loss", None)
    T = completion_ids.shape[1]
    out = model(**inputs, logits_to_keep=T + 1)
    return HeadInputs(out.logits[:, :-1, :]), getattr(out, "aux_loss", None)  # [B, T, V]


def rows_and_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    model_inputs: dict[str, torch.Tensor] | None,
    share_prompts: bool,
    chunked_path: bool = True,
) -> tuple[dict[str, Any], tuple[Any, torch.Tensor] | None]:
    """The ``[prompt | completion]`` rows' model inputs, and (on the chunked path, ``chunked_path``)
    ``_completion_hidden``'s result, each distinct prompt once when ``share_prompts`` and the rows
    have no image inputs (a prompt's images are read with it)."""
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, model, model_inputs)
    if not chunked_path:
        return inputs, None
    share = share_prompts and not model_inputs
    return inputs, _completion_hidden(
        model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, share
    )


def _row_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    model: torch.nn.Module | None = None,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The model inputs of the ``[prompt | completion]`` rows, positions counted over real tokens.

    With a vision-language model's ``model_inputs``, those are added; a model that places its
    image tokens in several position dimensions (Qwen-VL's 3-D rotary positions, from the grid
    sizes) computes its positions itself, from the tokens, image inputs and attention mask.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, P + T]
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "use_cache": False,
    }
    if model_inputs:
        inputs.update(model_inputs)
        if model is not None and chunked.positions_from_images(model):
            del inputs["position_ids"]
    return inputs


def _completion_hidden(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool,
) -> tuple[Any, torch.Tensor] | None:
    """The forward's output and the [B, T, H] final hidden states that predict the completion tokens.

    Each distinct prompt runs once when ``share_prompts`` and the model supports it
    (``ops/shared_prefix.py``). ``None`` when the chunked path does not apply to ``model`` (the
    caller then takes the model's own logits).
    """
    if not chunked.supports_chunked(model):
        return None
    groups = None
    if share_prompts and shared_prefix.supported(model):
        groups = shared_prefix.prompt_groups(prompt_ids, prompt_mask)
    rows, width = completion_ids.shape
    if groups is not None:  # each distinct prompt once, then the completions after it
        prompt_width = groups.ids.shape[1]
        forwards = [(groups.ids.shape[0], prompt_width, prompt_width), (rows, width, prompt_width + width)]
    else:
        forwards = [(rows, inputs["input_ids"].shape[1], inputs["input_ids"].shape[1])]
    with tied_embedding_grad(model), checkpointing.within_gradient_budget(model, forwards):
        if groups is not None:
            out, hidden, predicting = shared_prefix.hidden_states(
                model, groups, completion_ids, completion_mask
            )
        else:
            out, hidden = chunked.run_with_hidden(model, **inputs)  # [B, P + T, H]
            predicting = hidden[:, -(width + 1) : -1]  # position t predicts token t
    if not chunked.logits_match_head(model, out, hidden):  # checked once per model
        return None
    return out, predicting


def _stats_output(
    model: torch.nn.Module,
    out: object,
    hidden: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_size: int,
) -> PolicyOutput:
    """Log-probs and entropy from the hidden states [B, T, H] that predict the completion tokens."""
    head = chunked.causal_lm(model).get_output_embeddings()
    logps, entropy = chunked.token_stats(
        chunked.head_input(model, hidden), head.weight, head.bias, completion_ids, temperature,
        chunk_size, with_entropy, entropy_grad, product_dtype=chunked.head_product_dtype(model),
    )  # fmt: skip
    return PolicyOutput(logps=logps, entropy=entropy, aux_loss=getattr(out, "aux_loss", None))


def _naive_output(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor | bool],
    completion_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> PolicyOutput:
    """The full-logits path: the model's own logits of the completion positions, row by row.

    ``completion_ids`` may be [B, T, M]: M token ids per position.
    """
    T = completion_ids.shape[1]
    out = model(**inputs, logits_to_keep=T + 1)
    logits = out.logits[:, :-1, :]  # [B, T, V]: position t predicts completion token t
    if temperature != 1.0:
        logits = logits / temperature
    if completion_ids.dim() == 3:
        logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion_ids)
    else:
        logps = selective_log_softmax(logits, completion_ids)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return PolicyOutput(logps=logps, entropy=entropy, aux_loss=getattr(out, "aux_loss", None))
