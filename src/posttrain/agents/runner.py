"""What the trainer holds for agent training: the tools, the environment pool, the chosen chat
template and the tool loop, behind one ``rollout`` call per generation batch."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.agents.environments import (
    EnvironmentPool,
    apply_reset_prompt,
    environment_rewards,
    environment_tools,
    reward_column_names,
)
from posttrain.agents.loop import AgentRollout, LoopSettings, ToolLoop
from posttrain.agents.templates import resolve_template
from posttrain.agents.tools import Tool, combine_tool_tables, tool_table, tools_from_functions
from posttrain.generation.base import Generator


@dataclass
class AgentBatch:
    """One generation batch of episodes.

    Attributes:
        result: the loop's rollout, completions (as messages) and tool counts.
        prompts: the prompts the episodes started from (after ``reset`` added its text).
        environments: one environment per row, or ``None`` without ``environment_factory``.
        environment_rewards: [n, k] rewards of the environments' ``get_reward`` (k may be 0).
        faults: per environment reward column, how many ``get_reward`` calls failed and were
            skipped (``reward_fault_policy="skip"``).
    """

    result: AgentRollout
    prompts: list[list[dict[str, Any]]]
    environments: list[object] | None
    environment_rewards: torch.Tensor
    faults: dict[str, int]


class AgentRunner:
    """Runs tool-calling episodes for the trainer.

    Args:
        tools: plain functions exposed to every row.
        environment_factory: a class or callable making an environment, or a dict of them.
        tokenizer: the policy's tokenizer (its chat template must render tool calls).
        settings: the loop's limits and special tokens.
        fault_policy: ``reward_fault_policy``: ``"raise"`` stops on a failing ``get_reward``,
            ``"skip"`` leaves that episode unscored (NaN) and counts it.
        processor: a vision-language model's processor: prompts with images and tools that
            return images (``None``: a text-only model, which refuses both). Its chat template,
            when it has one, is the one the episodes render with.

    Raises:
        ValueError: a tool without schema, a clash of tool names, or a chat template that cannot
            carry tool calls.
        TypeError: an environment factory that does not make environments.
    """

    def __init__(
        self,
        tools: Sequence[Callable] | None,
        environment_factory: Any,
        tokenizer: Any,
        settings: LoopSettings,
        fault_policy: str = "raise",
        processor: Any = None,
    ) -> None:
        self.fault_policy = fault_policy
        self.tools = tool_table(tools_from_functions(list(tools or [])))
        self.pool = EnvironmentPool(environment_factory) if environment_factory is not None else None
        self._prototypes = self.pool.prototypes() if self.pool is not None else []
        classes = list(dict.fromkeys(type(env) for env in self._prototypes))
        self.reward_classes = [c for c in classes if callable(getattr(c, "get_reward", None))]
        self.reward_names = reward_column_names(self.reward_classes)
        schemas = self._all_schemas()
        template = getattr(processor, "chat_template", None)
        template = template if isinstance(template, str) else tokenizer.chat_template
        self.template = resolve_template(template, schemas, **settings.chat_template_kwargs)
        if self.template.substituted:
            warnings.warn(
                f"The tokenizer's chat template ({self.template.family} family) is not prefix preserving: adding a "
                "tool message changes how earlier messages render, which the tool loop cannot follow. posttrain "
                f"trains with its own prefix-preserving {self.template.family} template instead; save "
                "tokenizer.chat_template yourself if you need the original for inference.",
                stacklevel=3,
            )
        self.loop = ToolLoop(tokenizer, self.template, settings, processor)

    def _all_schemas(self) -> list[dict[str, Any]]:
        """Every schema a row may see (the template check renders them)."""
        schemas = [t.schema for t in self.tools.values()]
        for env in self._prototypes:
            schemas += [t.schema for t in environment_tools(env).values()]
        return schemas

    def rollout(
        self,
        generator: Generator,
        rows: list[dict[str, Any]],
        prompts: list[Any],
        device: torch.device,
        images: list[list[Any]] | None = None,
    ) -> AgentBatch:
        """Reset the environments, run the episodes, and score the environments.

        Args:
            generator: the sampling backend.
            rows: this process's dataset rows (their columns reach ``reset``).
            prompts: their prompts (``None`` when the environment owns the data).
            device: where the rollout tensors go.
            images: each row's prompt images (``image`` / ``images`` columns), or ``None``.
        """
        envs = self.pool.instances(rows) if self.pool is not None else None
        if envs is not None:
            prompts = [apply_reset_prompt(p, t) for p, t in zip(prompts, self.pool.reset_texts, strict=True)]
        conversations = [_as_conversation(p) for p in prompts]
        tables = [self._tools_for(env) for env in (envs or [None] * len(rows))]
        result = self.loop.run(generator, conversations, tables, device, images)
        env_rewards, faults = self._score(envs or [], len(rows))
        return AgentBatch(result, conversations, envs, env_rewards, faults)

    def _score(self, envs: list[object], n: int) -> tuple[torch.Tensor, dict[str, int]]:
        """The environments' rewards [n, k]; failures follow the fault policy."""
        if not envs or not self.reward_classes:
            return torch.zeros((n, len(self.reward_classes)), dtype=torch.float32), {}
        try:
            return environment_rewards(envs, self.reward_classes)[1], {}
        except (RuntimeError, TypeError):
            if self.fault_policy == "raise":
                raise
        rows, faults = [], {}  # skip: score episode by episode, so one failure spares the others
        for env in envs:
            try:
                rows.append(environment_rewards([env], self.reward_classes)[1])
            except (RuntimeError, TypeError):
                rows.append(torch.full((1, len(self.reward_classes)), float("nan")))
                name = self.reward_names[self.reward_classes.index(type(env))]
                faults[name] = faults.get(name, 0) + 1
        return torch.cat(rows), faults

    def _tools_for(self, env: object | None) -> dict[str, Tool]:
        if env is None:
            return self.tools
        return combine_tool_tables(self.tools, environment_tools(env))


def _as_conversation(prompt: Any) -> list[dict[str, Any]]:
    """Agent episodes are conversations: a plain-text prompt becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)
