"""Next-token log-probabilities and statistics of whole rows (SFT, the references, the pair scores).

``sequence_token_stats`` runs the model on whole rows and returns a ``SequenceStats``: each
position's log-prob of the next token, and where asked its entropy, top log-prob, mean logit and
``log Σ p²``, from the hidden states in chunks (``ops/chunked.py``) or from the full logits. Also
here: the log-softmax helpers both paths use, ``right_padding_only`` (a right-padding mask left to
the causal mask). ``ops/logprobs.py`` builds the per-row scores
on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops import checkpointing, chunked
from posttrain.ops.divergence import log_softmax
from posttrain.ops.tied_embedding import tied_embedding_grad


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
    model_inputs: dict[str, torch.Tensor] | None = None,
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
        model_inputs: a vision-language model's image inputs for these rows (pixel values, grid
            sizes, token types); a model that places image tokens in several position
            dimensions (Qwen-VL) then computes the positions itself.

    A 2-D mask of right padding only is not passed to the model (``right_padding_only``).
    """
    inputs = _forward_inputs(model, input_ids, attention_mask, position_ids, model_inputs)
    targets = input_ids[:, 1:]  # [N, L - 1]
    if chunk_size is not None and chunked.supports_chunked(model):
        forwards = [(input_ids.shape[0], input_ids.shape[1], input_ids.shape[1])]
        with tied_embedding_grad(model), checkpointing.within_gradient_budget(model, forwards):
            out, hidden = chunked.run_with_hidden(model, **inputs)  # [N, L, H]
        if chunked.logits_match_head(model, out, hidden):  # checked once per model
            return _stats_from_hidden(
                model, out, hidden[:, :-1], targets, chunk_size, with_entropy, with_top, with_logit_mean,
                with_log_sq_norm, target_mask,
            )  # fmt: skip
    return _stats_from_logits(
        model, inputs, targets, with_entropy, with_top, with_logit_mean, with_log_sq_norm
    )


def _forward_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    model_inputs: dict[str, torch.Tensor] | None,
) -> dict[str, Any]:
    """The model's keyword arguments for the rows: no mask of right padding only, the image inputs
    of a vision-language model (whose positions it may compute itself from its images)."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    if attention_mask is not None and not right_padding_only(model, attention_mask):
        inputs["attention_mask"] = attention_mask
    if model_inputs:
        inputs.update(model_inputs)
        if chunked.positions_from_images(model):
            del inputs["position_ids"]
    return inputs


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
        h, head.weight, head.bias, targets, 1.0, chunk_size, with_entropy, False, with_top=with_top,
        product_dtype=chunked.head_product_dtype(model),
    )  # fmt: skip
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
