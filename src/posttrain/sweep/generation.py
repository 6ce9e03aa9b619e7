"""One generation call for every run of a sweep, each row sampled with its own run's adapter.

When a run asks its generator for completions, the request waits while the other runs take their
turns (and add theirs); when the turn comes back to it, one call serves every waiting request:
the prompts concatenated (re-padded on the left to the longest), and each row routed through its
run's adapter (``TransformersGenerator.adapter_rows``: ``peft``'s mixed-adapter batches for the
prompts' forward, each distinct prompt and adapter run once; the fused decode step's low-rank
terms per row block). Requests with different sampling settings (temperature, top-p, length, ...)
are served by one call each. A decode step multiplies every base weight once for all the call's
rows, so N runs' steps cost less than N steps (figures: ``benchmarks/sweep_generation.py``).

With ``use_vllm`` the runs' adapters are served by one engine (``vllm_lora.SharedEngine``): one
``generate`` call of a colocated engine takes every waiting request, each prompt with its run's
adapter (``LoRARequest``) and sampling settings; a server gets the runs' requests at once
(``vllm_lora.generate_together``).

The rows of a shared call draw from the random generators of the run that makes the call, so a
run sampled this way equals a lone run in distribution, not draw for draw (``GRPOSweep`` with
``shared_generation=False`` keeps each run's own draws).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.generation.base import Samples


@dataclass
class Request:
    """One run's call to its generator, waiting for the shared call.

    Attributes:
        name: the run (its adapter's name).
        generator: the run's ``TransformersGenerator``.
        prompt_ids, prompt_mask: [N, P] left-padded prompts and their mask.
        max_new_tokens: the call's own budget (the tool loop's), or None.
        result: the completions, once served.
    """

    name: str
    generator: Any
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    max_new_tokens: int | None
    result: Samples | None = None

    def settings_key(self) -> str:
        """Requests with equal keys are served by one call: same sampling settings and budget
        (vLLM takes each prompt's own settings, so its requests are all served by one call)."""
        if _on_vllm(self.generator):
            return "vllm"
        config = self.generator.config.to_dict()
        options = [self.generator.prepack_weights, self.generator.lean, self.generator.sampler_precision]
        return json.dumps([config, self.max_new_tokens, options], sort_keys=True, default=str)


class SharedGeneration:
    """Batches the runs' generation requests into one call per round of turns.

    The runs' generators sample from the sweep's ``PeftModel`` (one adapter per run); the call
    names each row block's adapter (``TransformersGenerator.adapter_rows``).

    Args:
        hand_over: ``hand_over(name)``: run ``name`` lets every other run take a turn and gets
            the turn back (``GRPOSweep.hand_over``).
    """

    def __init__(self, hand_over: Callable[[str], None]) -> None:
        self.hand_over = hand_over
        self.pending: list[Request] = []
        #: How many shared calls were made, and how many rows they sampled.
        self.calls = 0
        self.rows = 0

    def attach(self, name: str, generator: Any) -> None:
        """Route run ``name``'s generator calls through the shared call (the instance's ``generate``)."""
        own = type(generator).generate
        if _on_vllm(generator):

            def generate_on_vllm(
                prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, engine_prompts: Any = None
            ) -> Samples:
                if engine_prompts is not None:  # rows with images: this run's own call
                    return own(generator, prompt_ids, prompt_mask, engine_prompts=engine_prompts)
                return self.request(Request(name, generator, prompt_ids, prompt_mask, None))

            generator.generate = generate_on_vllm
            return

        def generate(
            prompt_ids: torch.Tensor,
            prompt_mask: torch.Tensor,
            max_new_tokens: int | None = None,
            model_inputs: Any = None,
        ) -> Samples:
            if model_inputs:  # image inputs: this run's own call
                return own(generator, prompt_ids, prompt_mask, max_new_tokens, model_inputs)
            return self.request(Request(name, generator, prompt_ids, prompt_mask, max_new_tokens))

        generator.generate = generate

    def request(self, request: Request) -> Samples:
        """Queue ``request``, let the other runs queue theirs, then serve every waiting one."""
        self.pending.append(request)
        self.hand_over(request.name)
        if request.result is None:  # back first: this run makes the shared call
            self.serve(request.name)
        assert request.result is not None
        return request.result

    def serve(self, caller: str | None = None) -> None:
        """One call per group of waiting requests with the same sampling settings.

        If a call raises, the requests of the other runs that it left unserved wait for the next
        run to serve them; the error is the caller's (its run fails alone).
        """
        pending, self.pending = self.pending, []
        groups: dict[str, list[Request]] = {}
        for request in pending:
            groups.setdefault(request.settings_key(), []).append(request)
        try:
            for group in groups.values():
                self._serve_group(group)
        except BaseException:
            unserved = [r for r in pending if r.result is None and r.name != caller]
            self.pending = unserved + self.pending
            raise

    def _serve_group(self, group: list[Request]) -> None:
        if _on_vllm(group[0].generator):  # one engine call, each prompt with its run's adapter
            from posttrain.generation.vllm_lora import generate_together

            results = generate_together([(r.generator, r.prompt_ids, r.prompt_mask) for r in group])
            for request, samples in zip(group, results, strict=True):
                request.result = samples
            self.calls += 1
            self.rows += sum(r.prompt_ids.shape[0] for r in group)
            return
        width = max(r.prompt_ids.shape[1] for r in group)
        pad = group[0].generator.config.pad_token_id or 0
        ids = torch.cat([_left_pad(r.prompt_ids, width, pad) for r in group])
        mask = torch.cat([_left_pad(r.prompt_mask, width, 0) for r in group])
        generator = group[0].generator
        # each block of rows through its run's adapter: peft's mixed-adapter batches for the
        # prompts' forward (each distinct prompt and adapter prefilled once), the fused step's
        # low-rank terms for the decode steps
        generator.adapter_rows = [(r.name, r.prompt_ids.shape[0]) for r in group]
        try:
            samples = type(generator).generate(generator, ids, mask, group[0].max_new_tokens)
        finally:
            generator.adapter_rows = None
        self.calls += 1
        self.rows += ids.shape[0]
        start = 0
        for request in group:
            rows = request.prompt_ids.shape[0]
            part = slice(start, start + rows)
            request.result = Samples(
                completion_ids=samples.completion_ids[part],
                logps=None if samples.logps is None else samples.logps[part],
                lengths=None if samples.lengths is None else samples.lengths[part],
            )
            start += rows


def _on_vllm(generator: Any) -> bool:
    """Whether ``generator`` samples from a vLLM engine shared by the runs (``vllm_lora.SharedEngine``)."""
    return getattr(generator, "shared", None) is not None


def _left_pad(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """``tensor`` [N, P] padded on the left to [N, width] with ``value``."""
    extra = width - tensor.shape[1]
    if extra == 0:
        return tensor
    return torch.cat([tensor.new_full((tensor.shape[0], extra), value), tensor], dim=1)
