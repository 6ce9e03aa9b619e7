"""The online sampling pipeline: prompts -> generator -> rewards -> a scored batch.

Every trainer that samples from the policy while it trains (GRPO, RLOO and online DPO today;
on-policy distillation and asynchronous GRPO next) hands its batch of dataset rows to one
``OnlineSampler`` and gets back a ``Rollout`` and the per-function rewards. The sampler owns
the generation backend, the user's ``rollout_func``, the tool loop, the reward runner, DAPO's
dynamic sampling and the texts a completions table shows; it records the ``tools/*`` and
``dynamic_sampling/*`` metrics. It never computes advantages or losses: those are the family's.

Several processes: each process samples its own rows; the counts behind the metrics are
summed across processes, and dynamic sampling continues while any process still misses a group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather, gather_object

from posttrain.core.batch import Rollout
from posttrain.data import chat, formats, vision
from posttrain.generation.base import EnginePrompts, Generator, build_rollout, check_takes_images
from posttrain.generation.rollout_func import call_rollout_func
from posttrain.observe.metrics import MetricStore
from posttrain.ops.padding import left_pad
from posttrain.rewards.runner import RewardRunner
from posttrain.sampling import dynamic_sampling

logger = logging.getLogger(__name__)

# The column of the dataset made when the environment owns the data; never forwarded to ``reset``.
EPISODE_COLUMN = "posttrain_episode"

#: What a completions table shows of one sampled batch: prompts, completions, log_extra columns.
Texts = tuple[list[Any], list[Any], dict[str, list[Any]]]


@dataclass
class SamplerSettings:
    """What the sampler needs to know besides its parts.

    Attributes:
        eos_token_ids: ids that end a completion.
        pad_token_id: padding.
        chat_template_kwargs: extra arguments of the chat template for conversational prompts.
        pad_to_multiple_of: pad prompt batches to a multiple of this many tokens (``None``: no).
        max_prompt_length: keep only a prompt's last this many tokens (``None``: the whole prompt).
    """

    eos_token_ids: list[int]
    pad_token_id: int
    chat_template_kwargs: dict[str, Any] | None = None
    pad_to_multiple_of: int | None = None
    max_prompt_length: int | None = None


@dataclass
class OnlineSampler:
    """Samples completions for dataset rows and scores them.

    Attributes:
        tokenizer: the policy's tokenizer.
        generator: the generation backend (tests swap in a scripted one).
        rewards: the reward functions and models.
        settings: special tokens and rendering options.
        metrics: where ``tools/*`` and ``dynamic_sampling/*`` metrics go.
        device: where the batch tensors go.
        trainer: handed to ``rollout_func(prompts, trainer)``; its ``state`` reaches the reward
            functions as ``trainer_state``.
        agent: the tool loop (``agents.runner.AgentRunner``), when tools or environments are set.
        rollout_func: the user's own sampler, replacing ``generator``.
        processor: the model's processor when it reads images (a vision-language model): rows with
            an ``image`` / ``images`` column are encoded with it (``data.vision``); else ``None``.
        log_images: put each row's images into the image blocks of the prompts ``sampled_text``
            keeps (``log_completions`` with ``log_multimodal``: the completions log saves them).
        log_extra_columns: the columns reward functions added with ``log_extra`` in the last call.
        sampled_text: prompts, completions and extra columns of the last call.
        logged_paths: the generator's ``GenerationPath`` records already logged (each is logged
            once, at the first call that takes it: which path sampled, and why not the faster ones).
        collective: whether the processes sample together (the training loop's sampler), so counts
            may be summed over them; a background thread (asynchronous GRPO) samples alone and
            records its own process's ``tools/*`` frequencies.
    """

    tokenizer: Any
    generator: Generator
    rewards: RewardRunner
    settings: SamplerSettings
    metrics: MetricStore
    device: torch.device
    trainer: Any = None
    agent: Any = None
    rollout_func: Callable | None = None
    processor: Any = None
    log_images: bool = False
    log_extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    sampled_text: Texts = field(default_factory=lambda: ([], [], {}))
    logged_paths: set[Any] = field(default_factory=set)
    collective: bool = True

    @property
    def reward_names(self) -> list[str]:
        """One name per reward column: the reward functions', then the environments' ``get_reward``."""
        return list(self.rewards.names) + (self.agent.reward_names if self.agent is not None else [])

    def sample(self, batch: list[dict[str, Any]], mode: str, group: int) -> tuple[Rollout, torch.Tensor]:
        """One completion per row, scored: the rollout and [n, F] local rewards.

        Args:
            batch: this process's dataset rows, each prompt repeated ``group`` times in a row.
            mode: "train" or "eval" (the metrics' namespace).
            group: completions per prompt.
        """
        # a row's images without image blocks go at the start of its first user message, as in the reference
        prompts = [
            vision.place_images(row.get(formats.PROMPT_COLUMN), vision.row_images(row)) for row in batch
        ]
        if self.agent is not None:
            return self._sample_episodes(batch, prompts, mode)
        for i, p in enumerate(prompts):
            formats.check_prompt(p, f"{i} of this batch")
        extra: dict[str, Any] = {}
        if self.rollout_func is not None:
            s, images = self.settings, [vision.row_images(row) for row in batch]
            # a row with images goes to rollout_func as the reference hands it: every content a list of
            # blocks, each image in its image block
            given = [
                vision.with_images(vision.as_blocks(p), row_images) if row_images else p
                for p, row_images in zip(prompts, images, strict=True)
            ]
            result = call_rollout_func(
                self.rollout_func, given, group, self.trainer, s.eos_token_ids, s.pad_token_id, self.device
            )
            rollout, extra = result.rollout, result.extra
            if any(images):
                rollout.vision = self.rollout_func_vision(rollout, prompts, images)
        else:
            rollout = self.generate(prompts, [vision.row_images(row) for row in batch])
        completions, completion_ids = self._decode(rollout, prompts)
        kwargs = {**self._reward_kwargs(batch, prompts, completions, completion_ids, mode), **extra}
        rewards = self.rewards.score(len(batch), kwargs)
        self.sampled_text = (self._logged_prompts(prompts, batch), completions, dict(self.log_extra_columns))
        return rollout, rewards

    def _logged_prompts(self, prompts: list[Any], batch: list[dict[str, Any]]) -> list[Any]:
        """The prompts a completions log shows: with their rows' images in their image blocks when
        ``log_images``."""
        if not self.log_images:
            return prompts
        return [vision.with_images(p, vision.row_images(row)) for p, row in zip(prompts, batch, strict=True)]

    def generate(self, prompts: list[Any], images: list[list[Any]] | None = None) -> Rollout:
        """Render and tokenise the prompts (``encode_prompts``) and sample one completion each.

        ``images``: each row's images; with any, the processor encodes the rows
        (``encode_with_images``) and the image inputs go to the rollout and to the generator: the
        processor's tensors (``model_inputs``), or the images themselves with one placeholder per
        image (``EnginePrompts``) to an engine that runs the processor itself (vLLM).
        """
        if not images or not any(images):
            prompt_ids, prompt_mask = self.encode_prompts(prompts)
            samples = self.generator.generate(prompt_ids, prompt_mask)
            inputs = None
        else:
            prompt_ids, prompt_mask, inputs = self.encode_with_images(prompts, images)
            if getattr(self.generator, "runs_processor", False):
                ids = vision.placeholder_ids(
                    self.processor, self.tokenizer, prompts, self.settings.chat_template_kwargs
                )
                engine_prompts = EnginePrompts(ids, [list(row) for row in images])
                samples = self.generator.generate(prompt_ids, prompt_mask, engine_prompts=engine_prompts)
            else:
                kwargs = inputs.model_kwargs(prompt_ids.shape[1], 0, self.device)
                samples = self.generator.generate(prompt_ids, prompt_mask, model_inputs=kwargs)
        self._log_path()
        s = self.settings
        rollout = build_rollout(
            prompt_ids, prompt_mask, samples, s.eos_token_ids, self.tokenizer.pad_token_id
        )
        rollout.vision = inputs
        return rollout

    def _log_path(self) -> None:
        """Log the generator's path record (``GenerationPath``) the first time a call takes it."""
        path = getattr(self.generator, "path", None)
        if path is None or path in self.logged_paths:
            return
        self.logged_paths.add(path)
        logger.info("Generation path: %s", path.describe())

    def _require_processor(self) -> None:
        """Refuse rows with images when the processing class has no image processor."""
        if self.processor is None:
            raise ValueError(
                "The batch has images (an 'image' or 'images' column) but the processing class has no image "
                "processor; pass the model's processor (AutoProcessor.from_pretrained(...)) as processing_class."
            )

    def rollout_func_vision(
        self, rollout: Rollout, prompts: list[Any], images: list[list[Any]]
    ) -> vision.VisionInputs:
        """The image inputs of a ``rollout_func``'s rows for the forward passes that score them: the
        processor encodes each row's prompt with its images (``vision.encode_with_images``), and the
        token-aligned inputs follow the rollout's own prompt tokens (``vision.follow_prompt``).

        Raises:
            ValueError: there is no processor; a row's images do not match its placeholders; or
                its prompt tokens hold another number of image tokens than its images take.
        """
        self._require_processor()
        encoded, inputs = vision.encode_with_images(
            self.processor, self.tokenizer, prompts, images, self.settings.chat_template_kwargs
        )
        token = vision.image_token_of(self.processor)
        token_id = self.tokenizer.convert_tokens_to_ids(token) if token is not None else None
        rows = []
        for i, (row, ids, mask) in enumerate(
            zip(inputs.rows, rollout.prompt_ids.tolist(), rollout.prompt_mask.tolist(), strict=True)
        ):
            own = [t for t, m in zip(ids, mask, strict=True) if m]
            rows.append(
                vision.follow_prompt(row, encoded[i], own, token_id, f"row {i} of this batch") if row else row
            )
        return vision.VisionInputs(rows)

    def encode_with_images(
        self, prompts: list[Any], images: list[list[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, vision.VisionInputs]:
        """``encode_prompts`` for rows with images: the processor renders and tokenises each row.

        Returns:
            ``prompt_ids`` [N, P], ``prompt_mask`` [N, P] and the rows' image inputs.

        Raises:
            ValueError: there is no processor; or a row's images do not match its placeholders.
            NotImplementedError: the generator does not take image inputs.
        """
        self._require_processor()
        check_takes_images(self.generator)
        s = self.settings
        ids, inputs = vision.encode_with_images(
            self.processor, self.tokenizer, prompts, images, s.chat_template_kwargs
        )
        if s.max_prompt_length is not None and any(len(row) > s.max_prompt_length for row in ids):
            raise ValueError(
                f"A prompt with images is longer than max_prompt_length={s.max_prompt_length} tokens; cutting it "
                "would cut its image tokens. Raise max_prompt_length or leave it None."
            )
        prompt_ids, prompt_mask = left_pad(ids, self.tokenizer.pad_token_id, s.pad_to_multiple_of)
        return prompt_ids.to(self.device), prompt_mask.to(self.device), inputs

    def encode_prompts(
        self, prompts: list[Any], max_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Render and tokenise the prompts, left-padded on the device.

        Args:
            prompts: standard or conversational prompts.
            max_length: keep a prompt's last this many tokens instead of ``max_prompt_length``'s
                (SDPO's reprompts have their own budget).

        Returns:
            ``prompt_ids`` [N, P] and ``prompt_mask`` [N, P].
        """
        tok, s = self.tokenizer, self.settings
        limit = max_length if max_length is not None else s.max_prompt_length
        ids = [
            tok(chat.render_prompt(p, tok, s.chat_template_kwargs), add_special_tokens=isinstance(p, str))[
                "input_ids"
            ]
            for p in prompts
        ]
        if limit is not None:  # cut on the left: the question at the end stays
            ids = [row[-limit:] for row in ids]
        prompt_ids, prompt_mask = left_pad(ids, tok.pad_token_id, s.pad_to_multiple_of)
        return prompt_ids.to(self.device), prompt_mask.to(self.device)

    def _decode(self, rollout: Rollout, prompts: list[Any]) -> tuple[list[Any], list[list[int]]]:
        lengths = rollout.completion_lengths.tolist()
        completion_ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths, strict=True)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [formats.as_completion(t, p) for t, p in zip(texts, prompts, strict=True)], completion_ids

    def _reward_kwargs(
        self,
        batch: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        ids: list[list[int]],
        mode: str,
    ) -> dict[str, Any]:
        columns = {k: [row.get(k) for row in batch] for k in batch[0] if k != formats.PROMPT_COLUMN}
        self.log_extra_columns = {}
        return {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": ids,
            "trainer_state": getattr(self.trainer, "state", None),
            "log_metric": lambda name, value: self.metrics.add(mode, name, value),
            "log_extra": lambda column, values: self.log_extra_columns.__setitem__(column, list(values)),
        }

    def gathered_texts(self) -> Texts:
        """The last batch's prompts, completions and log_extra columns of every process, in rank
        order (as ``gather`` orders the rewards); every process must call this together."""
        per_process = gather_object([self.sampled_text])
        prompts = [p for ps, _, _ in per_process for p in ps]
        completions = [c for _, cs, _ in per_process for c in cs]
        names = dict.fromkeys(n for _, _, e in per_process for n in e)
        extra = {  # padded / cut per process: a wrong-length column must not break the log
            n: [v for ps, _, e in per_process for v in (list(e.get(n, [])) + [None] * len(ps))[: len(ps)]]
            for n in names
        }
        return prompts, completions, extra

    # ---- agents ----------------------------------------------------------------------------------

    def _sample_episodes(
        self, batch: list[dict[str, Any]], prompts: list[Any], mode: str
    ) -> tuple[Rollout, torch.Tensor]:
        """Agent rollouts (``agents/``): tool-calling episodes, scored by the reward functions and
        the environments' ``get_reward``."""
        rows = [{k: v for k, v in row.items() if k != EPISODE_COLUMN} for row in batch]
        images = [vision.row_images(row) for row in rows]
        out = self.agent.rollout(self.generator, rows, prompts, self.device, images if any(images) else None)
        rollout, completions = out.result.rollout, out.result.completions
        ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ]
        kwargs = self._reward_kwargs(rows, out.prompts, completions, ids, mode)
        if out.environments is not None:
            kwargs["environments"] = out.environments
        rewards = torch.cat([self.rewards.score(len(batch), kwargs), out.environment_rewards], dim=1)
        for name, count in out.faults.items():  # reported with the reward functions' faults
            self.rewards.faults[name] = self.rewards.faults.get(name, 0) + count
        self._record_tool_metrics(mode, out.result.tool_calls, out.result.tool_failures)
        self.sampled_text = (
            self._logged_prompts(out.prompts, rows),
            completions,
            dict(self.log_extra_columns),
        )
        return rollout, rewards

    def _record_tool_metrics(self, mode: str, calls: list[int], failures: list[int]) -> None:
        """``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed calls
        per call), from counts summed over processes (``collective``; else this process's)."""
        local = torch.tensor([float(len(calls)), float(sum(calls)), float(sum(failures))], device=self.device)
        summed = gather(local.unsqueeze(0)).sum(dim=0) if self.collective else local
        completions, total_calls, total_failures = summed.tolist()
        self.metrics.add_all(
            mode,
            {
                "tools/call_frequency": total_calls / max(completions, 1.0),
                "tools/failure_frequency": total_failures / total_calls if total_calls else 0.0,
            },
        )

    # ---- DAPO dynamic sampling -------------------------------------------------------------------

    def refill(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        group: int,
        weights: torch.Tensor,
        max_rounds: int,
        more: Iterator[list[dict[str, Any]]],
        slots: int | None = None,
        oversample: int = 1,
        prefer: str = "first",
    ) -> tuple[Rollout, torch.Tensor]:
        """Fill this process's batch with groups that have spread, sampling further rounds from ``more``.

        Args:
            rollout, rewards: the first round as sampled, [n] rows and [n, F] rewards: the batch's
                own groups, then its over-sampled ones.
            group: completions per prompt.
            weights: [F] reward weights (the spread is that of the weighted sum).
            max_rounds: most extra sampling rounds (``dynamic_sampling_max_rounds``).
            more: endless further batches of rows of this process.
            slots: groups the batch holds (default: every group of ``rollout``).
            oversample: per-process batches of ``more`` each extra round samples in one call.
            prefer: ``"first"`` (sampling order) or ``"hardest"`` (lowest mean reward first).
        """
        slots = rewards.shape[0] // group if slots is None else slots
        rollouts, scores, texts = [rollout], [rewards], [self.sampled_text]
        spread = [dynamic_sampling.groups_with_spread(rewards, weights, group)]
        missing = max(0, slots - int(spread[0].sum()))
        rounds = 0
        while rounds < max_rounds and self._on_any_process(missing > 0):
            rounds += 1
            rows = [row for _ in range(oversample) for row in next(more)]
            extra, extra_rewards = self.sample(rows, "train", group)
            ok = dynamic_sampling.groups_with_spread(extra_rewards, weights, group)
            rollouts.append(extra)
            texts.append(self.sampled_text)
            scores.append(extra_rewards)
            spread.append(ok)
            missing = max(0, missing - int(ok.sum()))
        means = None
        if prefer == "hardest":
            means = [dynamic_sampling.group_means(r, weights, group) for r in scores]
        chosen = dynamic_sampling.select_groups(spread, slots, means)
        self._record_refill(spread, chosen, slots, missing, rounds)
        if chosen == [(0, g) for g in range(slots)] and len(spread[0]) == slots:
            self.sampled_text = texts[0]
            return rollout, rewards
        merged = dynamic_sampling.take_groups(rollouts, chosen, group, self.tokenizer.pad_token_id)
        merged_rewards = torch.cat([scores[r][g * group : (g + 1) * group] for r, g in chosen])
        self.sampled_text = _take_texts(texts, chosen, group)
        return merged, merged_rewards

    def _record_refill(
        self, spread: list[torch.Tensor], chosen: list[tuple[int, int]], slots: int, missing: int, rounds: int
    ) -> None:
        """The ``dynamic_sampling/*`` metrics: the first round's groups without spread, the slots
        not holding the batch's own group, the slots left without spread, the extra rounds."""
        counts = torch.tensor(
            [float((~spread[0]).sum()), float(sum(r > 0 or g >= slots for r, g in chosen)), float(missing)],
            device=self.device,
        )
        dropped, refilled, unfilled = gather(counts.unsqueeze(0)).sum(dim=0).tolist()
        self.metrics.add_all(
            "train",
            {
                "dynamic_sampling/dropped_groups": dropped,
                "dynamic_sampling/refilled_groups": refilled,
                "dynamic_sampling/unfilled_groups": unfilled,
                "dynamic_sampling/rounds": float(rounds),
            },
        )

    def _on_any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process must call this together)."""
        return bool(gather(torch.tensor([float(flag)], device=self.device)).max().item() > 0)


def _take_texts(texts: list[Texts], chosen: list[tuple[int, int]], group: int) -> Texts:
    """Prompts, completions and log_extra columns of the chosen groups, in ``take_groups``' order."""
    rows = [(r, g * group + k) for r, g in chosen for k in range(group)]
    names = dict.fromkeys(n for _, _, extra in texts for n in extra)

    def cell(r: int, i: int, name: str) -> Any:
        values = texts[r][2].get(name)
        return values[i] if values is not None and i < len(values) else None

    return (
        [texts[r][0][i] for r, i in rows],
        [texts[r][1][i] for r, i in rows],
        {n: [cell(r, i, n) for r, i in rows] for n in names},
    )
