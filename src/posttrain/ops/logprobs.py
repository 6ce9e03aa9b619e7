"""Log-probabilities and entropy of completion tokens (online methods) and of whole rows (SFT).

The model is run on ``[prompt | completion]``; log-probs are taken of
``softmax(logits / temperature)``, the distribution the sampler drew from. Two paths compute them:

- chunked (the default where ``chunked.supports_chunked`` holds): the final hidden states of the
  completion positions are projected onto the vocabulary a chunk of token rows at a time, and
  recomputed in backward, so no ``[B, T, V]`` logits exist (``ops/chunked.py``);
- naive (any other model, or ``chunk_size=None``): the model's own logits of the completion
  positions (``logits_to_keep``), log-softmaxed one row at a time so at most one row's float32
  copy of ``[T, V]`` exists besides the logits themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops import checkpointing, chunked, shared_prefix, support
from posttrain.ops.divergence import HeadInputs, log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` uses them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., target]``, one row's ``[T, V]`` at a time: [B, T].

    Exact at high confidence, values and gradients (``divergence.log_softmax``: normalised with
    the argmax excluded), as the chunked path is.
    """
    out = []
    for row_logits, row_targets in zip(logits, targets, strict=True):  # [T, V], [T]
        logp = log_softmax(row_logits.float())
        out.append(logp.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def top_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The largest log-prob at each position, row by row: [B, T, V] -> [B, T] (no gradient).

    The same arithmetic as :func:`selective_log_softmax` (max of one ``log_softmax`` tensor, not
    ``max - logsumexp``), so where the target is the argmax the two compare equal bit for bit:
    ``mean_token_accuracy`` counts ``logps == top``.
    """
    with torch.no_grad():
        return torch.stack([log_softmax(row.float()).max(dim=-1).values for row in logits])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` at each position, row by row: [B, T, V] -> [B, T].

    Differentiable; call it on detached logits (or under ``no_grad``) when only the value is needed.
    """
    out = []
    for row_logits in logits:
        logp = log_softmax(row_logits.float())
        out.append(-(logp.exp() * logp).sum(dim=-1))
    return torch.stack(out)


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
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, model, model_inputs)
    share_prompts = share_prompts and not model_inputs
    targets = (
        completion_ids if extra_ids is None else torch.cat([completion_ids.unsqueeze(-1), extra_ids], -1)
    )
    if chunk_size is not None:
        found = _completion_hidden(
            model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts
        )
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a sampler reports of its completions: each token's log-prob and its top-``k`` tokens.

    One teacher-forced pass of the sampling model, without gradient, projected onto the
    vocabulary ``chunk_size`` positions at a time.

    Returns:
        ``(logps [B, T], top_logps [B, T, k], top_ids [B, T, k])`` in float32.
    """
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    found = _completion_hidden(model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, True)
    if found is not None:
        head = chunked.causal_lm(model).get_output_embeddings()
        return chunked.token_topk(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sampler_topk`` for a sampler with top-k / top-p / min-p (``ops/support.Truncation``).

    The support of each position is the sampler's filters applied to its own teacher-forced scores
    (the drawn token always in it); the log-probs are the softmax restricted to it.

    Returns:
        ``(logps [B, T], top_logps [B, T, k], top_ids [B, T, k], support [B, T, M])``; top slots
        past a support's size have log-prob ``-inf``, support ids past it are ``-1``.
    """
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    found = _completion_hidden(model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, True)
    if found is not None:
        head = chunked.causal_lm(model).get_output_embeddings()
        return chunked.token_topk_truncated(
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
) -> tuple[HeadInputs, Any]:
    """What ``model``'s LM head turns into the logits of each completion position (distillation).

    One forward of ``[prompt | completion]`` rows (each distinct prompt once where supported), with
    gradient if the caller has one. On the chunked path: the [B, T, H] hidden states that predict
    the completion tokens, with the head's weight and bias, so the vocabulary projection can be
    chunked (``ops/divergence.py``); otherwise the model's own [B, T, V] logits.

    Returns:
        ``(HeadInputs, aux_loss)``: ``aux_loss`` is a Mixture-of-Experts model's router loss, or ``None``.
    """
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    found = _completion_hidden(
        model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts
    )
    if found is not None:
        out, predicting = found
        head = chunked.causal_lm(model).get_output_embeddings()
        side = HeadInputs(chunked.head_input(model, predicting), head.weight, head.bias)
        return side, getattr(out, "aux_loss", None)
    T = completion_ids.shape[1]
    out = model(**inputs, logits_to_keep=T + 1)
    return HeadInputs(out.logits[:, :-1, :]), getattr(out, "aux_loss", None)  # [B, T, V]


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
        if model is not None and _positions_from_images(model):
            del inputs["position_ids"]
    return inputs


def _positions_from_images(model: torch.nn.Module) -> bool:
    """Whether the model derives its positions from its image inputs (a ``get_rope_index``)."""
    lm = chunked.causal_lm(model)
    return hasattr(lm, "get_rope_index") or hasattr(getattr(lm, "model", None), "get_rope_index")


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
    with sparse_tied_embedding_grad(model), checkpointing.within_gradient_budget(model, forwards):
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


@dataclass
class SequenceStats:
    """Per-token statistics of teacher-forced rows: position ``t`` scores token ``t + 1``.

    Attributes:
        logps: [N, L - 1] log-prob of each next token.
        entropy: [N, L - 1] entropy of each next-token distribution (no gradient), if asked for.
        top: [N, L - 1] the largest log-prob of each position (no gradient), if asked for; the
            next token is the argmax exactly where ``logps == top``.
        aux_loss: the router load-balancing loss of a Mixture-of-Experts model, if it reports one.
        logit_mean: [N, L - 1] the mean over the vocabulary of each position's logits (no
            gradient), if asked for: the reference's ``logits/*`` metrics.
        log_sq_norm: [N, L - 1] ``log sum_v p_v^2`` of each position (no gradient), if asked
            for: WPO's per-token weight is ``log p(y_t) - log_sq_norm``.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    top: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logit_mean: torch.Tensor | None = None
    log_sq_norm: torch.Tensor | None = None


def sequence_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    with_entropy: bool = False,
    with_top: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
    with_logit_mean: bool = False,
    with_log_sq_norm: bool = False,
    target_mask: torch.Tensor | None = None,
) -> SequenceStats:
    """Next-token log-probs of whole rows under ``model`` (SFT, and the log-probs of a reference).

    The logits are taken from the hidden states in chunks (``ops/chunked.py``): no ``[N, L, V]``
    float32 tensor is kept for backward. Models the chunked path does not support fall back to
    their own full logits.

    Args:
        model: a causal LM accepting ``logits_to_keep`` (possibly a ``PeftModel`` or DDP-wrapped).
        input_ids: [N, L] tokens.
        attention_mask: [N, L] 1 on real tokens, or a 4-D additive mask (packed rows), or ``None``.
        position_ids: [N, L] positions (restarting at every packed sequence).
        with_entropy: also the entropy of each position (no gradient).
        with_top: also the top log-prob of each position, for the accuracy.
        chunk_size: token rows projected onto the vocabulary at once; ``None`` forces full logits.
        with_logit_mean: also the mean logit of each position (no gradient; from the hidden
            states and the head's mean row, no ``[N, L, V]`` tensor).
        with_log_sq_norm: also ``log sum_v p_v^2`` of each position (no gradient; one more pass
            of the head over the positions, in chunks).
        target_mask: [N, L - 1] 1 on the positions whose statistics are wanted (the targets).
            On the chunked path the LM head then runs on those positions only (a prompt's or a
            padding's position costs a vocabulary projection for nothing) and every field is 0
            elsewhere; ``None``: every position.

    A 2-D mask of right padding only is not passed to the model (``right_padding_only``).
    """
    inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    if attention_mask is not None and not right_padding_only(model, attention_mask):
        inputs["attention_mask"] = attention_mask
    targets = input_ids[:, 1:]  # [N, L - 1]
    if chunk_size is not None and chunked.supports_chunked(model):
        forwards = [(input_ids.shape[0], input_ids.shape[1], input_ids.shape[1])]
        with sparse_tied_embedding_grad(model), checkpointing.within_gradient_budget(model, forwards):
            out, hidden = chunked.run_with_hidden(model, **inputs)  # [N, L, H]
        if chunked.logits_match_head(model, out, hidden):  # checked once per model
            return _stats_from_hidden(
                model, out, hidden[:, :-1], targets, chunk_size, with_entropy, with_top, with_logit_mean,
                with_log_sq_norm, target_mask,
            )  # fmt: skip
    return _stats_from_logits(
        model, inputs, targets, with_entropy, with_top, with_logit_mean, with_log_sq_norm
    )


def _stats_from_logits(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    with_entropy: bool,
    with_top: bool,
    with_logit_mean: bool,
    with_log_sq_norm: bool,
) -> SequenceStats:
    """The ``SequenceStats`` of the model's own full [N, L - 1, V] logits (the unchunked path)."""
    out = model(**inputs)
    logits = out.logits[:, :-1, :].float()  # [N, L - 1, V]
    logps = selective_log_softmax(logits, targets)
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    top = top_log_softmax(logits.detach()) if with_top else None
    result = SequenceStats(logps, entropy, top, getattr(out, "aux_loss", None))
    with torch.no_grad():
        if with_logit_mean:
            result.logit_mean = logits.mean(dim=-1)
        if with_log_sq_norm:
            result.log_sq_norm = torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)
    return result


def right_padding_only(model: torch.nn.Module, attention_mask: torch.Tensor) -> bool:
    """Whether ``attention_mask`` only marks right padding, so the causal mask alone gives the same targets.

    Under causal attention a real token never attends to the padding after it, so its hidden
    state, and every log-prob that scores a target, is the same without the mask; only the
    padding positions' outputs change, and no target reads them. Without a mask the attention
    kernel runs its causal path (``is_causal``), about 30 % faster than with an explicit mask
    on the CPU (SDPA, rows of 1k tokens). Kept for Mixture-of-Experts models, whose router
    loss counts the tokens the mask marks.

    Args:
        model: the model the rows go through.
        attention_mask: [N, L] 1 on real tokens (any other shape: ``False``).
    """
    if attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return False
    config = getattr(chunked.causal_lm(model), "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if any(getattr(text, name, None) for name in ("num_experts", "num_local_experts")):
        return False
    mask = attention_mask.bool()
    return bool(mask[:, 0].all()) and not bool((mask[:, 1:] & ~mask[:, :-1]).any())


def _stats_from_hidden(
    model: torch.nn.Module,
    out: Any,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    with_entropy: bool,
    with_top: bool,
    with_logit_mean: bool,
    with_log_sq_norm: bool,
    target_mask: torch.Tensor | None = None,
) -> SequenceStats:
    """``SequenceStats`` of ``targets`` [N, T] from the final hidden states [N, T, H] that predict them.

    With ``target_mask`` [N, T] the head runs on the marked positions only; the fields are
    scattered back to [N, T] with 0 elsewhere (the log-probs' gradient flows to the marked ones).
    """
    head = chunked.causal_lm(model).get_output_embeddings()
    h = chunked.head_input(model, hidden)
    keep = target_mask.bool() if target_mask is not None else None
    if keep is not None and bool(keep.all()):
        keep = None
    if keep is not None:
        h, targets = h[keep], targets[keep]  # [M, H], [M]
    stats = chunked.token_stats(
        h, head.weight, head.bias, targets, 1.0, chunk_size, with_entropy, False, with_top=with_top
    )
    result = SequenceStats(stats[0], stats[1], stats[2] if with_top else None, getattr(out, "aux_loss", None))
    if with_logit_mean or with_log_sq_norm:
        result.logit_mean, result.log_sq_norm = _head_summaries(
            h.detach(), head.weight, head.bias, chunk_size, with_logit_mean, with_log_sq_norm
        )
    if keep is None:
        return result

    def place(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        return values.new_zeros(keep.shape).index_put((keep,), values)

    return SequenceStats(
        place(result.logps), place(result.entropy), place(result.top), result.aux_loss,
        place(result.logit_mean), place(result.log_sq_norm),
    )  # fmt: skip


@torch.no_grad()
def _head_summaries(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_size: int,
    with_mean: bool,
    with_sq_norm: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-position mean logit and ``log sum_v p_v^2`` from hidden states [N, L, H], in chunks.

    The mean logit is linear in the hidden state: ``h . mean_v(W_v) + mean(b)``. The squared
    norm of the distribution is ``exp(logsumexp(2z) - 2 logsumexp(z))``.
    """
    mean = None
    if with_mean:
        w_bar = weight.float().mean(dim=0)  # [H]
        mean = hidden.float() @ w_bar + (bias.float().mean() if bias is not None else 0.0)
    if not with_sq_norm:
        return mean, None
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = torch.nn.functional.linear(flat[start : start + chunk_size], weight, bias).float()
        out[start : start + chunk_size] = torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)
    return mean, out.view(hidden.shape[:-1])


@contextlib.contextmanager
def sparse_tied_embedding_grad(model: torch.nn.Module) -> Iterator[None]:
    """While scoring, a trained input embedding tied to the LM head yields a sparse gradient.

    The embedding's backward otherwise builds a dense ``[V, H]`` gradient (113 MB for SmolLM2)
    only to add it to the head's; a sparse one (the looked-up rows) is added into the head's dense
    gradient in place by autograd, which sums both before the weight's single accumulation. So the
    weight's ``.grad`` stays dense and equal, and the end of backward no longer holds a second
    vocabulary-sized gradient. Only for a tied weight (the head's dense contribution is always
    there to add into) and an unwrapped model (DDP and sharding reduce gradients themselves).
    """
    lm = chunked.causal_lm(model)
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    usable = (
        torch.is_grad_enabled()
        and type(embed) is torch.nn.Embedding
        and head is not None
        and getattr(head, "weight", None) is embed.weight
        and embed.weight.requires_grad
        and not embed.sparse
        and embed.max_norm is None
        and not hasattr(model, "module")
        and type(embed.weight.data) is torch.Tensor
    )
    if not usable:
        yield
        return
    embed.sparse = True
    try:
        yield
    finally:
        embed.sparse = False


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
        chunk_size, with_entropy, entropy_grad,
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


@dataclass
class RowScores:
    """What scoring teacher-forced rows gives the offline preference trainers (DPO, KTO, ORPO, CPO).

    Attributes:
        logps: [N] the summed log-probs of each row's target tokens (``loss_mask``).
        lengths: [N] each row's number of target tokens.
        token_logps: [N, L - 1] per-token log-probs (position ``t`` scores token ``t + 1``).
        mask: [N, L - 1] 1 on the target tokens, in ``token_logps``' dtype.
        stats: the ``SequenceStats`` the scores came from (entropy, top, head summaries, aux loss).
    """

    logps: torch.Tensor
    lengths: torch.Tensor
    token_logps: torch.Tensor
    mask: torch.Tensor
    stats: SequenceStats


def score_rows(
    model: torch.nn.Module,
    rows: Any,
    *,
    with_metrics: bool = False,
    with_log_sq_norm: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
) -> RowScores:
    """Score right-padded rows (a ``core.batch.Sequences``) under ``model``: summed target log-probs.

    Args:
        model: the policy or a reference.
        rows: ``Sequences`` with ``input_ids``, ``loss_mask`` and a 2-D ``attention_mask``.
        with_metrics: also entropy, top log-prob and mean logit per position (no gradient).
        with_log_sq_norm: also ``log sum_v p_v^2`` per position (WPO).
        chunk_size: as in ``sequence_token_stats``.
    """
    positions = rows.position_ids
    if positions is None:
        positions = (rows.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    stats = sequence_token_stats(
        model,
        rows.input_ids,
        rows.attention_mask,
        positions,
        with_entropy=with_metrics,
        with_top=with_metrics,
        chunk_size=chunk_size,
        with_logit_mean=with_metrics,
        with_log_sq_norm=with_log_sq_norm,
        target_mask=rows.loss_mask[:, 1:],
    )
    mask = rows.loss_mask[:, 1:].to(stats.logps.dtype)  # [N, L - 1]
    return RowScores((stats.logps * mask).sum(dim=1), mask.sum(dim=1), stats.logps, mask, stats)


def score_completions(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    with_metrics: bool = False,
    with_log_sq_norm: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
) -> RowScores:
    """Score completions after their prompts, each distinct prompt run through the model once.

    The preference trainers' rows share prompts in pairs (a chosen and a rejected completion of
    each); where ``ops/shared_prefix.py`` supports the model, the prompt's forward, backward and
    recomputation happen once per pair instead of twice. Elsewhere the ``[prompt | completion]``
    rows are scored whole. The scores are in the completions' layout: ``token_logps[:, t]`` is
    completion token ``t``'s log-prob and ``mask`` is ``completion_mask``. The LM head runs on the
    completion tokens only (every field is 0 on the completions' padding).

    Args:
        model: the policy or a reference.
        prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
        completion_ids: [N, T] right-padded completions; completion_mask: [N, T] 1 on targets.
        with_metrics: also entropy, top log-prob and mean logit per position (no gradient).
        with_log_sq_norm: also ``log sum_v p_v^2`` per position (WPO).
        chunk_size: as in ``sequence_token_stats``; ``None`` forces full logits (whole rows).
    """
    inputs = _row_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    found = None
    if chunk_size is not None:
        found = _completion_hidden(
            model, inputs, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts=True
        )
    if found is not None:
        out, predicting = found
        stats = _stats_from_hidden(
            model, out, predicting, completion_ids, chunk_size, with_metrics, with_metrics, with_metrics,
            with_log_sq_norm, completion_mask,
        )  # fmt: skip
    else:
        start = prompt_ids.shape[1] - 1  # position P - 1 predicts completion token 0
        targets = torch.zeros_like(inputs["input_ids"][:, 1:])  # [N, P + T - 1]: the head runs on these
        targets[:, start:] = completion_mask
        whole = sequence_token_stats(
            model, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"],
            with_entropy=with_metrics, with_top=with_metrics, chunk_size=chunk_size,
            with_logit_mean=with_metrics, with_log_sq_norm=with_log_sq_norm, target_mask=targets,
        )  # fmt: skip

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[:, start:] if t is not None else None

        stats = SequenceStats(
            whole.logps[:, start:], cut(whole.entropy), cut(whole.top), whole.aux_loss,
            cut(whole.logit_mean), cut(whole.log_sq_norm),
        )  # fmt: skip
    mask = completion_mask.to(stats.logps.dtype)
    return RowScores((stats.logps * mask).sum(dim=1), mask.sum(dim=1), stats.logps, mask, stats)


def unpack_scores(scores: RowScores, lengths: torch.Tensor) -> RowScores:
    """Per-sequence ``RowScores`` of sequences packed end to end in one row.

    Args:
        scores: the scores of a packed batch ``[1, S]`` (``score_rows`` on a row whose
            ``position_ids`` restart at every sequence): per-token fields are ``[1, S - 1]``.
        lengths: [K] the tokens of each packed sequence, in order (their sum is at most ``S``;
            what follows is padding).

    Returns:
        ``RowScores`` with ``[K]`` sums and ``[K, max(lengths) - 1]`` per-token fields, laid out as
        if each sequence were its own right-padded row (position ``t`` scores token ``t + 1``).
        Gradients flow back to the packed log-probs.
    """
    if scores.token_logps.shape[0] != 1:
        raise ValueError(f"unpack_scores takes one packed row, got {scores.token_logps.shape[0]} rows.")
    device = scores.token_logps.device
    lengths = lengths.to(device=device, dtype=torch.long)
    starts = torch.cumsum(lengths, dim=0) - lengths  # [K]
    width = max(int(lengths.max()) - 1, 1)
    offsets = torch.arange(width, device=device)
    inside = offsets[None, :] < (lengths[:, None] - 1)  # [K, W]: positions scoring a token of the sequence
    index = torch.where(inside, starts[:, None] + offsets[None, :], 0)  # [K, W] into the packed positions

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return t[0][index] if t is not None else None

    mask = take(scores.mask) * inside.to(scores.mask.dtype)
    token_logps = take(scores.token_logps)
    s = scores.stats
    stats = SequenceStats(
        take(s.logps), take(s.entropy), take(s.top), s.aux_loss, take(s.logit_mean), take(s.log_sq_norm)
    )
    return RowScores((token_logps * mask).sum(dim=1), mask.sum(dim=1), token_logps, mask, stats)
