"""A2POTrainer: A*-PO (Optimal Advantage Regression) on the shared online core.

Two stages; the sampling, the reference's log-probs and the buffer are
``sampling.OnlineTrainer``'s, shared with GRPO, RLOO and online DPO::

    stage 1 (once, before the first step; cached in output_dir/a2po_values.jsonl):
        rewards[x, :N] = score(N reference samples of x)      # every train and eval prompt
        V*(x)          = value_estimates(rewards, beta1)      # losses.py
        drop the train prompts with every reward 0            # filter_all_incorrect
    stage 2 (each step): one completion y of each prompt x from the policy
        A    = r(x, y) - V*(x)                                # _advantages
        loss = (beta2 * log pi/pi_ref (y|x) - A)^2, mean      # losses.regression_loss
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import broadcast_object_list, gather, gather_object
from transformers import PreTrainedModel, TrainerCallback

from posttrain.a2po import losses
from posttrain.a2po.config import A2POConfig
from posttrain.a2po.values import VALUES_FILE, ValueStore, row_key
from posttrain.core.batch import Rollout
from posttrain.models import peft as peft_utils
from posttrain.rewards.runner import weighted_sum
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]

#: Sampling options the stage-1 samples depend on (a cached file must match them).
_SAMPLING_FIELDS = (
    "num_value_samples",
    "max_prompt_length",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "generation_kwargs",
    "chat_template_kwargs",
    "reward_weights",
)


class A2POTrainer(OnlineTrainer):
    """Trainer for A*-PO: a value estimate from reference samples, then one-sample regression.

    The reference's public API (``trl.experimental.a2po.A2POTrainer``). See ``docs/online.md``.

    Stage 1 runs at the start of ``train()`` (and of ``evaluate()``), before the first step:
    ``num_value_samples`` completions of every training and evaluation prompt are sampled from
    the reference (the policy as given; the adapters-off base under PEFT) and scored; their
    rewards are appended to ``output_dir/a2po_values.jsonl`` as they come, so an interrupted
    stage 1 resumes where it stopped and a resumed run samples nothing again.

    Args:
        model: hub id, local path, embedded name, a ``PreTrainedModel`` causal LM or a
            ``peft.PeftModel``.
        reward_funcs: reward functions or reward models; their weighted sum must be 0 or 1 on
            every completion (A*-PO assumes a binary, verifiable reward).
        args: an ``A2POConfig``; defaults to one with ``output_dir="<model name>-A2PO"``.
        train_dataset, eval_dataset: map-style datasets with a ``prompt`` column (text or
            messages); other columns reach the reward functions as keyword arguments.
        processing_class: the policy's tokenizer; reward_processing_classes: the reward models'.
        callbacks, optimizers, peft_config, quantization_config: as ``GRPOTrainer``.
    """

    _bf16_sampler_copy = True  # its loss never reads the sampler's log-probs

    _tag_names = ["posttrain", "a2po"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: A2POConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: Any = None,
        quantization_config: Any = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, A2POConfig, "A2PO")
        if not isinstance(args, A2POConfig):
            raise TypeError(
                f"args is a {type(args).__name__}; A2POTrainer needs an A2POConfig (beta1, beta2, "
                "num_value_samples, one completion per prompt)."
            )
        for name, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            _check_map_style(name, data)
        super().__init__(
            model=model,
            args=args,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.value_store: ValueStore | None = None
        self._filtered = False
        self._row_values = torch.zeros(0)

    @property
    def _prompt_token_budget(self) -> int | None:
        """``max_prompt_length``: a longer prompt keeps its last tokens, as the reference's."""
        return self.args.max_prompt_length

    @property
    def _loss_temperature(self) -> float:
        """1: the regression onto the optimal advantage reads the policy's and the reference's own
        log-probs (A*-PO's log-ratio; the reference library's too); ``temperature`` shapes sampling."""
        return 1.0

    def _setup_reference(self) -> torch.nn.Module | None:
        """A frozen copy of the policy as given (``None`` under PEFT: the adapters-off base)."""
        return self._offline_reference(None)

    def _needs_ref_logps(self) -> bool:
        """Always: the regression target is the log-ratio to the reference."""
        return True

    # ---- stage 1: V*(x) from reference samples -------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Stage 1 (the value estimates, cached), then stage 2 (``transformers.Trainer.train``)."""
        self.estimate_values()
        return super().train(*args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The evaluation loss; the prompts' value estimates are sampled first if missing."""
        given = eval_dataset if eval_dataset is not None and not isinstance(eval_dataset, str) else None
        self.estimate_values(given)
        return super().evaluate(eval_dataset, *args, **kwargs)

    def estimate_values(self, extra_dataset: Any = None) -> None:
        """Make sure every training and evaluation prompt has its ``num_value_samples`` rewards.

        Missing prompts are sampled from the reference, ``per_device_eval_batch_size`` prompts per
        process at a time, and appended to ``output_dir/a2po_values.jsonl``. Then, once, the
        training prompts whose samples all scored 0 are dropped (``filter_all_incorrect``).

        Raises:
            ValueError: a reward that is not 0 or 1; every training prompt dropped; a values file
                written under other settings.
        """
        rows = self._all_rows(extra_dataset)
        if self.value_store is None:
            self.value_store = self._load_store()
        missing: dict[str, dict[str, Any]] = {}
        for row in rows:
            key = row_key(row)
            if key not in self.value_store.rewards:
                missing.setdefault(key, row)
        if missing:
            self._sample_values(list(missing.items()))
        if not self._filtered:
            self._filtered = True
            self._filter_train_dataset()

    def _all_rows(self, extra_dataset: Any) -> list[dict[str, Any]]:
        datasets = [self.train_dataset, *self._eval_datasets()]
        if extra_dataset is not None:
            _check_map_style("eval_dataset", extra_dataset)
            datasets.append(extra_dataset)
        return [dict(row) for data in datasets if data is not None for row in data]

    def _load_store(self) -> ValueStore:
        """The main process reads the file; every process gets the same store."""
        a = self.args
        settings = {name: getattr(a, name) for name in _SAMPLING_FIELDS}
        settings["model"] = str(getattr(self.model.config, "_name_or_path", ""))
        settings["rewards"] = list(self._reward_names)
        path = os.path.join(a.output_dir, VALUES_FILE)
        box: list[Any] = [None]
        if self.accelerator.is_main_process:
            try:
                box = [ValueStore.load(path, settings).rewards]
            except ValueError as error:
                box = [error]
        broadcast_object_list(box)
        if isinstance(box[0], ValueError):
            raise box[0]
        return ValueStore(path, settings, dict(box[0]))

    def _sample_values(self, missing: list[tuple[str, dict[str, Any]]]) -> None:
        """Sample and score ``num_value_samples`` reference completions of each missing prompt."""
        a, store = self.args, self.value_store
        n, world, rank = a.num_value_samples, a.world_size, self.accelerator.process_index
        per = a.per_device_eval_batch_size  # no gradients: the evaluation batch size
        rounds = math.ceil(len(missing) / (per * world))
        bar = None
        if self.accelerator.is_main_process and not a.disable_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(missing), desc=f"A*-PO stage 1: V*(x) from {n} reference samples", unit="prompt"
            )
        with self._reference_sampling():
            for r in range(rounds):
                start = (r * world + rank) * per
                mine = missing[start : start + per]
                real = len(mine)
                if world > 1:  # every process samples as many rows (generation may hold collectives)
                    mine = mine + [missing[0]] * (per - real)
                batch = [row for _, row in mine for _ in range(n)]
                _, rewards = self.sampler.sample(batch, "eval", n)
                total = weighted_sum(rewards, self.reward_weights)
                self._check_binary(rewards, total, "stage 1 (reference samples)")
                per_prompt = total.view(len(mine), n)[:real].tolist()
                found = gather_object([{key: v for (key, _), v in zip(mine[:real], per_prompt, strict=True)}])
                merged = {k: v for part in found for k, v in part.items()}
                store.add(merged, write=self.accelerator.is_main_process)
                if bar is not None:
                    bar.update(len(merged))
        if bar is not None:
            bar.close()
        self._metrics.pop_means("eval")  # what reward functions logged while sampling stage 1
        self.rewards.pop_faults()

    @contextlib.contextmanager
    def _reference_sampling(self) -> Iterator[None]:
        """Sampling from the reference: the frozen copy stands in for the policy while stage 1
        generates (so prompts first met by ``evaluate()`` mid-training are still sampled from the
        reference); under PEFT, the base with the adapters off. A generator that keeps its own
        copy of the weights (vLLM) is told on the way in and out."""
        swapped = getattr(self.generator, "weights_changed", None) or (lambda: None)
        swapped()
        try:
            if peft_utils.is_peft_model(self.model):
                with peft_utils.adapters_disabled(self.model):
                    yield
                return
            policy, self.model = self.model, self.ref_model  # the generator reads self.model at each call
            try:
                yield
            finally:
                self.model = policy
        finally:
            swapped()

    def _filter_train_dataset(self) -> None:
        """Drop the training prompts the reference never solved (``filter_all_incorrect``) and say so."""
        a, store = self.args, self.value_store
        keys = [row_key(dict(row)) for row in self.train_dataset]
        solved = [any(r > 0 for r in store.rewards[k]) for k in keys]
        values = losses.value_estimates(torch.tensor([store.rewards[k] for k in keys]), a.beta1)
        if self.accelerator.is_main_process:
            print(
                f"A*-PO stage 1: {len(keys)} training prompts, {a.num_value_samples} reference samples each "
                f"({store.path}); solved at least once: {sum(solved)}/{len(keys)}; mean V*: "
                f"{values.mean().item():.4f}"
                + (f"; dropping the {len(keys) - sum(solved)} never solved" if a.filter_all_incorrect else "")
            )
        if not a.filter_all_incorrect or all(solved):
            return
        if not any(solved):
            raise ValueError(
                f"none of the {len(keys)} training prompts got a reward of 1 on any of its {a.num_value_samples} "
                "reference samples, so filter_all_incorrect=True drops them all: check that the reward function "
                "scores this model's completions, raise num_value_samples or max_completion_length, or set "
                "filter_all_incorrect=False."
            )
        self.train_dataset = self.train_dataset.select([i for i, ok in enumerate(solved) if ok])

    def _check_binary(self, rewards: torch.Tensor, total: torch.Tensor, stage: str) -> None:
        """Raise on the first reward that is not 0 or 1, naming the value, the prompt and the completion.

        Args:
            rewards: [n, F] the per-function rewards of the last sampled batch.
            total: [n] their weighted sum.
            stage: where it happened, for the message.
        """
        bad = losses.first_non_binary(total)
        if bad is None:
            return
        prompts, completions, _ = self.sampler.sampled_text
        raw = ", ".join(
            f"{name}={v:g}" for name, v in zip(self._reward_names, rewards[bad].tolist(), strict=False)
        )
        raise ValueError(
            f"A*-PO needs a binary reward (0 or 1), but in {stage} sample {bad} scored {total[bad].item()!r} "
            f"({raw}): prompt {_short(prompts[bad])}, completion {_short(completions[bad])}. Use a reward "
            "that returns 1.0 for a correct completion and 0.0 otherwise (e.g. answer_accuracy_reward), and "
            "reward_weights whose weighted sum stays 0 or 1."
        )

    # ---- stage 2: one completion per prompt, regressed onto r - V* ------------------------------

    def _sample(self, batch: list[dict[str, Any]], mode: str) -> tuple[Rollout, torch.Tensor]:
        """The shared sampling; the rewards checked binary and the rows' ``V*`` looked up."""
        rollout, rewards = super()._sample(batch, mode)
        self._check_binary(rewards, weighted_sum(rewards, self.reward_weights), f"{mode} sampling")
        keys = [row_key(dict(row)) for row in batch]
        known = self.value_store.rewards if self.value_store is not None else {}
        missing = sum(k not in known for k in keys)
        if missing:
            raise RuntimeError(
                f"{missing} prompts have no value estimate; call trainer.estimate_values(dataset) before "
                "sampling them (train() and evaluate() do)."
            )
        samples = torch.tensor([known[k] for k in keys])
        self._row_values = losses.value_estimates(samples, self.args.beta1)  # [n]
        return rollout, rewards

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``r - V*(x)`` of every process's completions; the ``v_star`` and ``advantage`` metrics."""
        values = gather(self._row_values.to(self.accelerator.device)).cpu()  # [N]
        adv = weighted_sum(rewards, self.reward_weights).to(values.dtype) - values
        return adv, {"v_star": values.mean().item(), "advantage": adv.mean().item()}

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The regression loss of one micro-batch (its share of the step's mean over completions)."""
        out, mode = self._policy_forward(model, inputs, return_outputs)
        mask = self._loss_mask(inputs.rollout)
        loss, implicit = losses.regression_loss(
            out.logps, inputs.ref_logps, mask, inputs.advantages, self.args.beta2, inputs.norms
        )
        sums = gather(
            torch.stack([implicit.sum(), torch.tensor(float(implicit.numel()))])
            .float()
            .to(self.accelerator.device)
        )
        metrics = {"implicit_reward": (sums[0::2].sum() / sums[1::2].sum().clamp(min=1.0)).item()}
        loss = self._with_aux_loss(loss, out, inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss


def _check_map_style(name: str, dataset: Any) -> None:
    """Stage 1 visits every prompt before training: an iterable (streamed) dataset cannot be used."""
    from torch.utils.data import IterableDataset as TorchIterable

    try:
        from datasets import IterableDataset, IterableDatasetDict
    except ImportError:  # pragma: no cover - datasets is a dependency
        IterableDataset = IterableDatasetDict = ()  # type: ignore[assignment,misc]
    values = dataset.values() if isinstance(dataset, dict) else [dataset]
    if any(isinstance(d, (IterableDataset, IterableDatasetDict, TorchIterable)) for d in values):
        raise ValueError(
            f"{name} is an iterable (streamed) dataset, but A*-PO estimates V*(x) of every prompt before "
            "training, so it needs a map-style dataset: load it without streaming=True (or convert it with "
            "Dataset.from_generator)."
        )


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
