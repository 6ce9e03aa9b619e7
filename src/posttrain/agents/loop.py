"""The multi-turn tool loop: generate a turn, parse its tool calls, run them, append the results,
and continue only the rows that called a tool.

Every row is an *episode*: its rendered prompt, the completion tokens so far (model turns and
the tool results between them) and the completion as chat messages. Model tokens are kept as
sampled; only the text a tool turn adds (the template's tool messages and the next generation
prompt) is tokenised, on its own, so the history is never re-tokenised. A row stops when a turn
has no tool call, when ``max_tool_calling_iterations`` tool rounds have run, when a turn is cut
by the length budget, or when the completion (all turns and tool results) reaches
``max_completion_length`` tokens or the sequence reaches the model's maximum length.

The result is a ``Rollout`` whose ``tool_mask`` is 0 on the tokens the loop inserted, so they
are attended to but never trained on, and never counted as completion tokens.

With a vision-language model's processor, a prompt's images and the images a tool returns
(``{"type": "image", "image": ...}`` content blocks) enter the episode: the text that holds their
placeholders is tokenised by the processor (each placeholder expands into its image's tokens),
and every later turn is sampled, and the completion scored, with all the episode's images
(``agents/vision.py``). A tool result whose image tokens do not fit in the remaining budget ends
the episode without being inserted (a cut image could not be read).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.agents.templates import (
    TURN_END,
    TemplateChoice,
    continuation_text,
    parse_tool_calls,
)
from posttrain.agents.tools import Tool, run_tool_calls
from posttrain.agents.types import ToolCall, ToolResult
from posttrain.agents.vision import EpisodeImages, batch_inputs, encode_with_processor, rollout_inputs
from posttrain.core.batch import Rollout
from posttrain.data import vision
from posttrain.data.chat import render_template, special_tokens
from posttrain.generation.base import Generator, check_takes_images
from posttrain.ops.padding import left_pad


@dataclass
class LoopSettings:
    """Limits and special tokens of the loop.

    Attributes:
        max_completion_length: the budget of all turns and tool results together, in tokens.
        max_tool_calling_iterations: most tool rounds per episode; ``None`` is unlimited.
        max_model_length: most tokens of prompt plus completion (the model's context), or ``None``.
        eos_token_ids: tokens that end a turn.
        pad_token_id: padding.
        chat_template_kwargs: extra keyword arguments for the chat template.
    """

    max_completion_length: int
    max_tool_calling_iterations: int | None
    max_model_length: int | None
    eos_token_ids: list[int]
    pad_token_id: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One row's state through the loop."""

    prompt: list[dict[str, Any]]
    prompt_ids: list[int]
    tools: dict[str, Tool]
    schemas: list[dict[str, Any]] | None
    messages: list[dict[str, Any]] = field(default_factory=list)  # the completion, as messages
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: inserted
    tool_rounds: int = 0
    calls: int = 0
    failures: int = 0
    done: bool = False
    terminated: bool = False
    pending: list[ToolCall] = field(default_factory=list)  # calls of the last turn, to run
    vision: EpisodeImages = field(default_factory=EpisodeImages)  # its images (vision-language models)


@dataclass
class AgentRollout:
    """What the loop hands back to the trainer.

    Attributes:
        rollout: prompt and completion tensors; ``tool_mask`` marks the model's tokens.
        completions: per row, the completion as chat messages (assistant turns and tool messages).
        tool_calls: per row, how many tool calls the model made.
        tool_failures: per row, how many of them failed.
    """

    rollout: Rollout
    completions: list[list[dict[str, Any]]]
    tool_calls: list[int]
    tool_failures: list[int]


class ToolLoop:
    """Runs episodes of generate -> tool calls -> tool results until every row stops.

    Args:
        tokenizer: the policy's tokenizer.
        template: the chat template and family chosen by ``templates.resolve_template``.
        settings: limits and special tokens.
        processor: a vision-language model's processor (prompts with images, tools returning
            images); ``None`` for a text-only model, which refuses both.
    """

    def __init__(
        self, tokenizer: Any, template: TemplateChoice, settings: LoopSettings, processor: Any = None
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.settings = settings
        self.processor = processor
        # what tokenizer.apply_chat_template passes too: the special tokens (bos_token, ...)
        self._template_kwargs = {**special_tokens(tokenizer), **settings.chat_template_kwargs}

    def run(
        self,
        generator: Generator,
        prompts: list[list[dict[str, Any]]],
        tools: list[dict[str, Tool]],
        device: torch.device,
        images: list[list[Any]] | None = None,
    ) -> AgentRollout:
        """Run one episode per prompt.

        Args:
            generator: any ``Generator``; if its ``generate`` accepts ``max_new_tokens`` the loop
                passes the largest remaining budget, otherwise it cuts longer turns itself. With
                images it must accept ``model_inputs`` (the transformers backend does).
            prompts: conversational prompts, one per row.
            tools: the tools each row may call (rows may see different tools).
            device: where the generator's inputs go.
            images: each row's prompt images (one per ``{"type": "image"}`` block), or ``None``.

        Returns:
            The ``AgentRollout`` of the batch.

        Raises:
            ValueError: images (in a prompt or a tool result) without a processor, or whose count
                does not match the placeholders the template rendered.
        """
        images = images or [[] for _ in prompts]
        episodes = [
            self._start(p, t, row_images, i)
            for i, (p, t, row_images) in enumerate(zip(prompts, tools, images, strict=True))
        ]
        for i, e in enumerate(episodes):
            self._check_prompt_length(e, i)
        while active := [e for e in episodes if not e.done]:
            turns = self._generate(generator, active, device)
            pending = [e for e, turn in zip(active, turns, strict=True) if self._take_turn(e, *turn)]
            if pending:
                self._run_tools(pending)
        return self._finish(episodes, device)

    # ---- one episode ---------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> str:
        return render_template(self.template.template, messages, schemas, True, **self._template_kwargs)

    def _start(
        self, prompt: list[dict[str, Any]], tools: dict[str, Tool], images: list[Any], row: int
    ) -> Episode:
        schemas = [t.schema for t in tools.values()] or None
        text = self._render(prompt, schemas)
        if not images:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return Episode(prompt=prompt, prompt_ids=list(ids), tools=tools, schemas=schemas)
        if self.processor is None:
            raise ValueError(
                f"Row {row} has images, but the model is text-only (its processing class has no image processor), "
                "so they cannot enter the episode. Train a vision-language model with its processor as "
                "processing_class, or drop the 'image'/'images' column."
            )
        vision.check_row_images(prompt, images, f"{row} of this batch", vision.image_token_of(self.processor))
        ids, inputs = encode_with_processor(self.processor, text, images, f"the prompt of row {row}")
        e = Episode(prompt=prompt, prompt_ids=ids, tools=tools, schemas=schemas)
        e.vision.set_prompt(inputs, images)
        return e

    def _budget(self, e: Episode) -> int:
        s = self.settings
        left = s.max_completion_length - len(e.ids)
        if s.max_model_length is not None:
            left = min(left, s.max_model_length - len(e.prompt_ids) - len(e.ids))
        return left

    def _check_prompt_length(self, e: Episode, row: int) -> None:
        limit = self.settings.max_model_length
        if limit is not None and len(e.prompt_ids) >= limit:
            raise ValueError(
                f"The prompt of row {row} renders to {len(e.prompt_ids)} tokens (tool schemas included), but the "
                f"model's maximum length is {limit}, so nothing can be generated. Shorten the prompt or the tool "
                "docstrings, or use a model with a longer context."
            )

    def _generate(
        self, generator: Generator, active: list[Episode], device: torch.device
    ) -> list[tuple[list[int], bool]]:
        """Sample one turn for every active row: (tokens up to and including EOS, ended with EOS)."""
        budgets = [self._budget(e) for e in active]
        ids, mask = left_pad([e.prompt_ids + e.ids for e in active], self.settings.pad_token_id)
        kwargs: dict[str, Any] = {"max_new_tokens": max(budgets)} if _accepts_budget(generator) else {}
        if any(e.vision.has_images for e in active):  # the whole episode so far is the prompt
            inputs = batch_inputs([e.vision for e in active], [len(e.prompt_ids) for e in active])
            kwargs["model_inputs"] = inputs.model_kwargs(ids.shape[1], 0, device)
            check_takes_images(generator, ("model_inputs",))
        samples = generator.generate(ids.to(device), mask.to(device), **kwargs)
        eos = set(self.settings.eos_token_ids)
        rows = samples.completion_ids.tolist()
        if samples.lengths is not None:  # the source's own lengths: its padding may be the EOS token
            rows = [row[:n] for row, n in zip(rows, samples.lengths.tolist(), strict=True)]
        turns = []
        for row, budget in zip(rows, budgets, strict=True):
            end = next((i for i, t in enumerate(row) if t in eos), None)
            if end is not None and end < budget:
                turns.append((row[: end + 1], True))
            else:
                turns.append((row[:budget], False))
        return turns

    def _take_turn(self, e: Episode, tokens: list[int], ended: bool) -> bool:
        """Record a sampled turn; return whether its tool calls must run."""
        e.ids += tokens
        e.model_mask += [1] * len(tokens)
        e.vision.extend(len(tokens))
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
        content, calls = parse_tool_calls(self.template.family, text)
        e.messages.append(_assistant_message(content, calls))
        if not ended:  # cut by the length budget: the episode ends unfinished
            e.done = True
            return False
        limit = self.settings.max_tool_calling_iterations
        if not calls or (limit is not None and e.tool_rounds >= limit):
            e.done = e.terminated = True
            return False
        e.calls += len(calls)
        e.pending = calls
        return True

    def _run_tools(self, pending: list[Episode]) -> None:
        """Run every pending row's calls together (async tools concurrently), append the results."""
        results = run_tool_calls([e.pending for e in pending], [e.tools for e in pending])
        for e, row_results in zip(pending, results, strict=True):
            e.failures += sum(r.failed for r in row_results)
            self._append_results(e, row_results)

    def _append_results(self, e: Episode, results: list[ToolResult]) -> None:
        images = [image for r in results for image in r.images]
        named = ", ".join(repr(r.name) for r in results if r.images)
        if images and self.processor is None:
            raise ValueError(
                f"Tool {named} returned an image, but the model is text-only (its processing class has no image "
                "processor), so the image cannot reach it. Train a vision-language model with its processor as "
                "processing_class, or return text from the tool."
            )
        tool_messages = [{"role": "tool", "name": r.name or "", "content": r.content} for r in results]
        text = continuation_text(
            self.template.template,
            e.prompt + e.messages,
            tool_messages,
            e.schemas,
            # the family's end-of-turn text, as the template writes it (the model may end a
            # turn with another EOS, e.g. Llama's <|eom_id|> after a python_tag call)
            TURN_END[self.template.family],
            **self._template_kwargs,
        )
        e.messages += tool_messages
        e.tool_rounds += 1
        room = max(self._budget(e), 0)
        inputs = None
        if images:
            inserted, inputs = encode_with_processor(
                self.processor, text, images, f"the result of tool {named}"
            )
            if len(inserted) > room:  # a cut image could not be read: the episode ends before it
                e.done = True
                return
        else:
            inserted = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        e.ids += inserted[:room]
        e.model_mask += [0] * min(len(inserted), room)
        e.vision.extend(min(len(inserted), room), inputs, images)
        if len(inserted) >= room:  # no room left for another model turn
            e.done = True

    # ---- the batch -----------------------------------------------------------------------------

    def _finish(self, episodes: list[Episode], device: torch.device) -> AgentRollout:
        pad = self.settings.pad_token_id
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad)
        width = max(max((len(e.ids) for e in episodes), default=0), 1)
        completion = torch.full((len(episodes), width), pad, dtype=torch.long)
        completion_mask = torch.zeros_like(completion)
        tool_mask = torch.zeros_like(completion)
        for i, e in enumerate(episodes):
            n = len(e.ids)
            completion[i, :n] = torch.tensor(e.ids, dtype=torch.long)
            completion_mask[i, :n] = 1
            tool_mask[i, :n] = torch.tensor(e.model_mask, dtype=torch.long)
        rollout = Rollout(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=completion.to(device),
            completion_mask=completion_mask.to(device),
            is_terminated=torch.tensor([e.terminated for e in episodes], device=device),
            tool_mask=tool_mask.to(device),
            vision=rollout_inputs([e.vision for e in episodes])
            if any(e.vision.has_images for e in episodes)
            else None,
        )
        return AgentRollout(
            rollout=rollout,
            completions=[e.messages for e in episodes],
            tool_calls=[e.calls for e in episodes],
            tool_failures=[e.failures for e in episodes],
        )


def _accepts_budget(generator: Generator) -> bool:
    """Whether ``generator.generate`` takes ``max_new_tokens`` (the per-turn budget)."""
    params = inspect.signature(generator.generate).parameters
    return "max_new_tokens" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_message_call() for c in calls]
    return message
