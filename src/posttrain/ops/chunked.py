"""Completion log-probs and entropy from hidden states, chunk by chunk, recomputed in backward.

The naive way to score ``N = B * T`` completion tokens builds ``[N, V]`` logits (V is the
vocabulary, 49152 for SmolLM2) and keeps them, plus float32 log-softmax copies, alive until
the backward pass. Here the model's backbone yields the final hidden states ``[N, H]`` and
``TokenStats`` projects them onto the vocabulary ``chunk_size`` rows at a time, keeping only
``[N]`` results (the chosen token's log-prob, the log-partition and the entropy). Its backward
recomputes each chunk's logits and turns ``grad_logps`` and ``grad_entropy`` into gradients of
the hidden states and of the LM head's weight (and bias). At most one chunk's ``[chunk, V]``
float32 logits (and two or three work copies of it) exist at any time, in forward and backward.

The math, with ``z = (h @ W^T + b) / temperature``, ``lse = logsumexp(z)``, ``log p = z - lse``:

- log-prob of target ``y``: ``z_y - lse``; ``d/dz = onehot(y) - p``;
- entropy ``H = -sum(p * log p)``; ``dH/dz = -p * (log p + H)``.

How the hidden states are obtained: the model is called as usual, through whatever wraps it
(DDP, a ``PeftModel``), with ``logits_to_keep=1`` so its own head projects a single position;
a forward hook on the decoder (``get_decoder()``) captures ``last_hidden_state``. Going through
the wrapper keeps DDP's gradient synchronisation, PEFT's forward and a Mixture-of-Experts
model's router loss (``aux_loss``) exactly as in the naive path; gradient checkpointing of the
decoder layers is unaffected. The one projected position doubles as a check: the first time a
model is seen, its own logits there are compared with ``lm_head(hidden)``; a model that
transforms its logits in a way ``supports_chunked`` does not know of is then sent, with a
warning, to the naive path for good.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DEFAULT_CHUNK_SIZE = 256
"""Token rows projected at once. One chunk's float32 logits take ``chunk_size * V * 4`` bytes (50 MB
for SmolLM2's V = 49152), and forward holds two such buffers at most, backward one (two with the
entropy's gradient). On the embedded model 256 rows gave 16 % less peak step memory than 1024 at
T = 1024 (``benchmarks/logprobs_memory.py``), and a [256, H] x [H, V] product is still a large matmul."""

# config fields of transformers models whose logits are not plainly lm_head(hidden)
_LOGIT_TRANSFORMS: dict[str, Callable[[Any], bool]] = {
    "final_logit_softcapping": lambda v: v is not None and v != 0,  # Gemma 2/3: cap * tanh(z / cap)
    "logit_scale": lambda v: v is not None and v != 1,  # Cohere: z * logit_scale
    "logits_scaling": lambda v: v is not None and v != 1,  # Granite: z / logits_scaling
}


# ---- the kernel ----------------------------------------------------------------------------


def _scaled_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``(h @ W^T + b) / temperature`` in float32 (float64 stays float64): [c, H] -> [c, V]."""
    z = nn.functional.linear(h, weight, bias)
    z = z.to(_stats_dtype(z.dtype))  # a fresh tensor either way: safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax statistics are taken in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_top: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of each target, log-partition, entropy and top log-prob of one chunk: [c, H] -> 4 x [c].

    ``targets`` is [c], or [c, M] for M targets per row (the log-probs are then [c, M]).
    """
    z = _scaled_logits(h, weight, bias, temperature)  # [c, V]
    lse = torch.logsumexp(z, dim=-1)  # [c]
    many = _as_columns(targets)  # [c, M]
    logps = (z.gather(1, many) - lse.unsqueeze(1)).view(targets.shape)  # [c] or [c, M]
    top = z.max(dim=-1).values - lse if with_top else None  # [c]; == logps where the target is the argmax
    entropy = None
    if with_entropy:
        logp_all = z.sub_(lse.unsqueeze(1))  # [c, V], in place: z is no longer needed
        entropy = -(logp_all.exp().mul_(logp_all)).sum(dim=-1)  # [c]
    return logps, lse, entropy, top


def _chunk_grad_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Gradient of the loss wrt one chunk's raw logits ``h @ W^T + b``, in the weight's dtype: [c, V].

    One [c, V] float32 buffer without the entropy's gradient, two with it. The 1 / temperature of
    ``dz / dlogits`` is folded into the [c] coefficients.
    """
    g_cols = _as_columns(grad_logps / temperature) if grad_logps is not None else None  # [c, M]
    g_lp = g_cols.sum(dim=1) if g_cols is not None else None  # [c]: every target's -p part at once
    g_ent = grad_entropy / temperature if grad_entropy is not None else None  # [c]
    logp_all = _scaled_logits(h, weight, bias, temperature).sub_(lse.unsqueeze(1))  # [c, V]
    if g_ent is None:
        grad = logp_all.exp_().mul_(-g_lp.unsqueeze(1))  # d log p_y / dz = onehot(y) - p: the -p part
    else:
        probs = logp_all.exp()  # [c, V]
        # dH/dz = -p * (log p + H), written over logp_all's storage
        grad = logp_all.add_(entropy.unsqueeze(1)).mul_(probs).mul_(-g_ent.unsqueeze(1))
        if g_lp is not None:
            grad.sub_(probs.mul_(g_lp.unsqueeze(1)))
    if g_cols is not None:
        grad.scatter_add_(1, _as_columns(targets), g_cols.to(grad.dtype))  # the onehot(y) parts
    return grad.to(weight.dtype)


def _as_columns(values: torch.Tensor) -> torch.Tensor:
    """[c] -> [c, 1]; [c, M] stays."""
    return values.unsqueeze(1) if values.dim() == 1 else values


class TokenStats(torch.autograd.Function):
    """Chosen-token log-probs and entropy of ``softmax((h @ W^T + b) / temperature)``, chunked.

    Inputs: hidden [N, H], weight [V, H], bias [V] or ``None``, targets [N] or [N, M] (long), then the
    Python values temperature, chunk_size, with_entropy, entropy_grad, with_top. Outputs: logps
    [N] (or [N, M]: one per target), entropy [N] (float32, or float64 for a float64 head; an empty tensor when
    ``with_entropy`` is off; not differentiable unless ``entropy_grad``) and the top log-prob
    [N] (empty unless ``with_top``; never differentiable; equal to ``logps`` where the target is
    the argmax). Saved for backward: hidden, weight and three [N] vectors.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        entropy_grad: bool,
        with_top: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, dtype = hidden.shape[0], _stats_dtype(weight.dtype)
        logps = hidden.new_empty(targets.shape, dtype=dtype)  # [N] or [N, M]
        lse = hidden.new_empty(n, dtype=dtype)  # [N]
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)  # [N] or [0]
        top = hidden.new_empty(n if with_top else 0, dtype=dtype)  # [N] or [0]
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            lp, ls, ent, tp = _chunk_stats(
                hidden[rows], weight, bias, targets[rows], temperature, with_entropy, with_top
            )
            logps[rows], lse[rows] = lp, ls
            if ent is not None:
                entropy[rows] = ent
            if tp is not None:
                top[rows] = tp
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(top, *([] if with_entropy and entropy_grad else [entropy]))
        return logps, entropy, top

    @staticmethod
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, grad_top: Any = None
    ):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if entropy.numel() == 0:
            grad_entropy = None
        grad_h, grad_w, grad_b = _grad_buffers(ctx.needs_input_grad, hidden, weight, bias)
        if grad_logps is None and grad_entropy is None:
            return _finish(grad_h, grad_w, grad_b, weight, bias)
        chunk = ctx.chunk_size
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            g = _chunk_grad_logits(  # [c, V]
                hidden[rows],
                weight,
                bias,
                targets[rows],
                lse[rows],
                entropy[rows] if grad_entropy is not None else None,
                grad_logps[rows] if grad_logps is not None else None,
                grad_entropy[rows] if grad_entropy is not None else None,
                ctx.temperature,
            )
            _accumulate(g, hidden[rows], weight, rows, grad_h, grad_w, grad_b)
        return _finish(grad_h, grad_w, grad_b, weight, bias)


def _grad_buffers(
    needs: tuple[bool, ...], hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Zeroed gradient buffers for the inputs that need one; the head's in float32 (summed over chunks)."""
    grad_h = torch.zeros_like(hidden) if needs[0] else None  # [N, H]
    dtype = _stats_dtype(weight.dtype)
    grad_w = torch.zeros_like(weight, dtype=dtype) if needs[1] else None  # [V, H]
    grad_b = torch.zeros_like(bias, dtype=dtype) if bias is not None and needs[2] else None  # [V]
    return grad_h, grad_w, grad_b


def _accumulate(
    g: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: slice,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> None:
    """Add one chunk's share: ``dh = g @ W``, ``dW += g^T @ h``, ``db += sum(g)``; g: [c, V], h: [c, H]."""
    if grad_h is not None:
        grad_h[rows] = g @ weight  # [c, H]
    if grad_w is not None:
        if g.dtype == grad_w.dtype:
            grad_w.addmm_(g.t(), h)  # [V, H]
        else:
            grad_w.add_(g.t() @ h)
    if grad_b is not None:
        grad_b.add_(g.sum(dim=0, dtype=grad_b.dtype))  # [V]


def _finish(
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """Backward's return value: the buffers in their inputs' dtypes, ``None`` for the rest."""
    grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
    grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
    return grad_h, grad_w, grad_b, None, None, None, None, None, None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    with_top: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probs and entropy of ``targets`` under ``softmax((hidden @ W^T + b) / temperature)``.

    Args:
        hidden: [..., H] final hidden states, already in the head's dtype.
        weight: [V, H] LM head weight; bias: [V] or ``None``.
        targets: [...] token ids, or [..., M]: M token ids per position (their log-probs share
            one projection onto the vocabulary).
        temperature: the logits are divided by it.
        chunk_size: token rows projected onto the vocabulary at once.
        with_entropy: also return the entropy.
        entropy_grad: let the entropy carry a gradient (otherwise it is detached).
        with_top: also return the top log-prob of each position (no gradient); the target is the
            argmax exactly where it equals the target's log-prob (``mean_token_accuracy``).

    Returns:
        ``(logps, entropy)``, float32 with ``targets``' shape; ``entropy`` (and ``top``) have
        ``hidden``'s leading shape; ``entropy`` is ``None`` unless asked for; with ``with_top``,
        ``(logps, entropy, top)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of token rows, got {chunk_size}.")
    shape = hidden.shape[:-1]
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    many = targets.dim() == hidden.dim()  # [..., M]: several targets per position
    flat_t = targets.reshape(-1, targets.shape[-1]) if many else targets.reshape(-1)
    logps, entropy, top = TokenStats.apply(
        flat_h,
        weight,
        bias,
        flat_t,
        temperature,
        chunk_size,
        with_entropy,
        entropy_grad,
        with_top,
    )
    out = logps.view(targets.shape), (entropy.view(shape) if with_entropy else None)
    return (*out, top.view(shape)) if with_top else out


@torch.no_grad()
def token_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    k: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each target's log-prob and the ``k`` most likely tokens of each position, without gradient.

    Args:
        hidden: [..., H] final hidden states in the head's dtype; targets: [...] token ids.

    Returns:
        ``(logps [...], top_logps [..., k], top_ids [..., k])``, log-probs in float32 or wider.
    """
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    dtype = _stats_dtype(weight.dtype)
    logps = flat_h.new_empty(flat_t.shape[0], dtype=dtype)
    top_logps = flat_h.new_empty(flat_t.shape[0], k, dtype=dtype)
    top_ids = flat_t.new_empty(flat_t.shape[0], k)
    for start in range(0, flat_t.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        z = _scaled_logits(flat_h[rows], weight, bias, temperature)  # [c, V]
        z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))
        logps[rows] = z.gather(1, flat_t[rows].unsqueeze(1)).squeeze(1)
        top = z.topk(k, dim=-1)
        top_logps[rows], top_ids[rows] = top.values, top.indices
    return logps.view(shape), top_logps.view(*shape, k), top_ids.view(*shape, k)


# ---- which models, and their hidden states --------------------------------------------------


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers (the one with the LM head)."""
    while True:
        if hasattr(model, "get_base_model"):  # PeftModel
            model = model.get_base_model()
        elif not hasattr(model, "get_output_embeddings") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module  # DistributedDataParallel, DeepSpeedEngine, FSDP (v1)
        else:
            return model


def _is_sharded(model: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the head's weight is partitioned (FSDP, DeepSpeed ZeRO-3): not whole outside forward."""
    wrappers = []
    while isinstance(getattr(model, "module", None), nn.Module):
        wrappers.append(type(model).__name__)
        model = model.module
    dtensor = type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor"
    return (
        dtensor or hasattr(weight, "ds_id") or weight.numel() == 0 or "FullyShardedDataParallel" in wrappers
    )


def _plain_linear_head(head: Any) -> bool:
    """An ``nn.Linear`` itself (not LoRA, quantized or offloaded), with at most input pre-hooks."""
    return (
        type(head) is nn.Linear
        and not hasattr(head, "_hf_hook")  # accelerate offloading / device maps replace forward
        and not head._forward_hooks
        and not head._forward_pre_hooks_with_kwargs
    )


def supports_chunked(model: nn.Module) -> bool:
    """Whether the chunked path computes exactly what ``model(...).logits`` would.

    True for a transformers causal LM (plain, inside DDP, or a ``PeftModel`` whose adapters do not
    touch the LM head) whose logits are ``lm_head(decoder(x).last_hidden_state)``: the head is a
    plain ``nn.Linear``, tied to the input embeddings or not, possibly cast to float32 by
    ``cast_lm_head_to_fp32`` (its input pre-hooks are applied to the hidden states). Mixture-of-
    Experts models qualify: their router loss comes from the same forward call.

    False (the naive full-logits path is used) for: logits transformed after the head (Gemma's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``); an LM head
    that is wrapped (LoRA on ``lm_head``, ``modules_to_save``, quantized, offloaded) or has output
    hooks; a sharded head weight (FSDP, DeepSpeed ZeRO-3); a model without ``get_decoder``. A
    model that transforms its logits some other way is caught at its first call (module docstring).
    """
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_output_embeddings") or not hasattr(lm, "get_decoder"):
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(test(getattr(text_config, name, None)) for name, test in _LOGIT_TRANSFORMS.items()):
        return False
    head = lm.get_output_embeddings()
    return _plain_linear_head(head) and not _is_sharded(model, head.weight)


def head_input(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as the LM head sees it: its input pre-hooks applied (the float32 cast), in its dtype."""
    head = causal_lm(model).get_output_embeddings()
    for hook in head._forward_pre_hooks.values():
        result = hook(head, (hidden,))
        if result is not None:
            hidden = result[0] if isinstance(result, tuple) else result
    return hidden.to(head.weight.dtype)


def run_with_hidden(model: nn.Module, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """Call ``model(**inputs, logits_to_keep=1)`` and catch the decoder's final hidden states.

    Returns:
        The model's output (its ``logits`` cover the last position only) and the hidden
        states [B, L, H] of every position.
    """
    captured: list[torch.Tensor] = []
    lm = causal_lm(model)

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if hidden is not None else output[0]
        captured.append(hidden)
        # the head's product runs under the same autocast (accelerate wraps the whole forward
        # and casts the logits back to float32, so their dtype does not tell)
        device = hidden.device.type
        _AUTOCAST_SEEN[lm] = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    handle = causal_lm(model).get_decoder().register_forward_hook(keep)
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(causal_lm(model)).__name__}.get_decoder() was not called in forward.")
    return out, captured[-1]


_VERIFIED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
#: the autocast dtype the model's latest ``run_with_hidden`` forward ran under (None: none)
_AUTOCAST_SEEN: weakref.WeakKeyDictionary[nn.Module, torch.dtype | None] = weakref.WeakKeyDictionary()


def logits_match_head(model: nn.Module, out: Any, hidden: torch.Tensor) -> bool:
    """Once per model: whether its own last-position logits equal ``lm_head(hidden)`` there.

    Args:
        model: the model called by ``run_with_hidden``.
        out: its output; ``out.logits`` is [B, 1, V].
        hidden: [B, L, H] the captured hidden states.

    Returns:
        The verdict, remembered for the model; a ``False`` also warns once.
    """
    lm = causal_lm(model)
    if lm in _VERIFIED:
        return _VERIFIED[lm]
    head = lm.get_output_embeddings()
    with torch.no_grad():
        ours = nn.functional.linear(
            head_input(model, hidden[:, -1]), head.weight, head.bias
        ).float()  # [B, V]
        theirs = out.logits[:, -1].float()  # [B, V]
        # bf16 logits (autocast) come from a bf16 product, ours from a float32 one (or another
        # bf16 kernel): judge them at the precision they were computed in, not the weights'
        dtypes = [head.weight.dtype, out.logits.dtype, _AUTOCAST_SEEN.get(lm) or head.weight.dtype]
        precision = max(torch.finfo(d).eps for d in dtypes)
        tol = 8 * precision
        ok = bool(torch.allclose(ours, theirs, rtol=tol, atol=tol * float(theirs.abs().max())))
    _VERIFIED[lm] = ok
    if not ok:
        warnings.warn(
            f"{type(lm).__name__} computes its logits differently from lm_head(hidden_states); its completion "
            "log-probs are taken from full logits instead of the chunked path (more memory).",
            stacklevel=3,
        )
    return ok
