"""Configuration of the KTO trainer: ``KTOConfig``, a drop-in for ``trl.KTOConfig`` (TRL 1.16).

Only KTO's own fields are declared here. The fields the offline trainers share (``max_length``,
``pad_to_multiple_of``, ``dataset_num_proc``, ``activation_offloading``, ``pad_token``,
``router_aux_loss_coef``) and the validation machinery come from ``core.config``; the valid
loss types come from the loss table of ``kto/losses.py``.
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import OfflineConfig, Rule, choice_rules, is_num, optional, positive_int
from posttrain.kto import losses

__all__ = ["KTOConfig"]

CHOICES: dict[str, tuple[str, ...]] = {"loss_type": tuple(losses.LOSS_TYPES)}

# fmt: off
_RULES: tuple[Rule, ...] = OfflineConfig._rules + (
    Rule("beta", lambda v: is_num(v) and v > 0, "a positive number", "set beta to a positive number such as 0.1"),
    Rule("desirable_weight", lambda v: is_num(v) and v >= 0, "a number >= 0", "set desirable_weight to a weight such as 1.0"),
    Rule("undesirable_weight", lambda v: is_num(v) and v >= 0, "a number >= 0", "set undesirable_weight to a weight such as 1.0"),
    Rule("precompute_ref_batch_size", optional(positive_int), "None or a positive integer", "set precompute_ref_batch_size to a batch size, or leave it None"),
    Rule("ref_model_sync_steps", positive_int, "a positive integer", "set ref_model_sync_steps to 1 or more (512 by default)"),
    Rule("ref_model_mixup_alpha", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]", "set ref_model_mixup_alpha between 0 and 1 (0.6 by default)"),
) + choice_rules(CHOICES)
# fmt: on


@dataclass
class KTOConfig(OfflineConfig):
    r"""Configuration of :class:`~posttrain.kto.trainer.KTOTrainer`, a drop-in for ``trl.KTOConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`max_length=1024`, `pad_to_multiple_of="auto"`, `dataset_num_proc`,
    `activation_offloading`, `pad_token`, `router_aux_loss_coef`, `model_init_kwargs`,
    `trust_remote_code`, `logging_steps=10`, `gradient_checkpointing=True`, `bf16=None`) and
    the KTO parameters below.

    TrainingArguments default changed for KTO:
        learning_rate (`float`, defaults to `1e-6` instead of `5e-5`): Initial learning rate.

    TrainingArguments default kept (the reference changes it):
        train_sampling_strategy (`str`, defaults to `"random"`): the reference sets
            `"sequential"` and requires it with `loss_type="kto"`, because it fixes the KL pairs
            while preprocessing, in chunks of the batch size. posttrain builds them inside each
            micro-batch when it is collated, so any sampler gives pairs from the batch, and
            random batches mix desirable and undesirable examples (a converted pair dataset
            holds its chosen examples first). Set `"sequential"` for the reference's order.

    Model:
        disable_dropout (`bool`, defaults to `True`): Turn dropout off in the policy (and the
            reference).

    Reference:
        precompute_ref_log_probs (`bool`, defaults to `False`): Score the examples (and, for
            `"kto"`, their KL pairs, then fixed before training) with the reference once before
            training and keep no reference model while training.
        precompute_ref_batch_size (`int | None`, defaults to `None`): Examples scored at once
            when precomputing; `None` uses `per_device_train_batch_size` (and
            `per_device_eval_batch_size` for the eval sets).
        sync_ref_model (`bool`, defaults to `False`): TR-DPO: mix the policy into the reference
            every `ref_model_sync_steps` steps, `ref <- alpha * policy + (1 - alpha) * ref`.
        ref_model_mixup_alpha (`float`, defaults to `0.6`): TR-DPO's alpha.
        ref_model_sync_steps (`int`, defaults to `512`): TR-DPO's tau.

    Loss:
        loss_type (`str`, defaults to `"kto"`): `"kto"` (Ethayarajh et al. 2024; needs
            `per_device_train_batch_size` >= 2 for its KL pairs) or `"apo_zero_unpaired"`
            (APO-zero on unpaired data, no KL term). See `kto.losses.LOSS_TYPES`.
        beta (`float`, defaults to `0.1`): The inverse temperature of the implicit reward.
        desirable_weight (`float`, defaults to `1.0`): λ_D, the weight of desirable examples'
            losses.
        undesirable_weight (`float`, defaults to `1.0`): λ_U, the weight of undesirable
            examples' losses. The paper advises λ_D n_D / (λ_U n_U) in [1, 4/3]; the trainer
            warns, with a suggested `desirable_weight`, when the training set falls outside.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _RULES

    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Turn dropout off in the policy and the reference."}
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Score the examples and their KL pairs with the reference once, before training."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Examples scored at once when precomputing; None: the batch size."}
    )
    loss_type: str = field(default="kto", metadata={"help": f"One of {', '.join(losses.LOSS_TYPES)}."})
    beta: float = field(default=0.1, metadata={"help": "Inverse temperature of the implicit reward."})
    desirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of the desirable examples' losses."}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of the undesirable examples' losses."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: mix the policy into the reference."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO's alpha."})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO: steps between reference syncs."}
    )

    def _check_combinations(self) -> None:
        super()._check_combinations()
        if self.uses_kl and self.per_device_train_batch_size < 2:
            raise ValueError(
                f"loss_type='kto' estimates its KL term from mismatched prompt/completion pairs inside each "
                f"micro-batch, so it needs per_device_train_batch_size >= 2; got {self.per_device_train_batch_size}. "
                "Raise per_device_train_batch_size (lower gradient_accumulation_steps to keep the step's size), "
                "or use loss_type='apo_zero_unpaired', which has no KL term."
            )
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ValueError(
                "desirable_weight=0 and undesirable_weight=0 weigh every example's loss by 0, so nothing is "
                "learnt. Give at least one of them a positive weight (both are 1.0 by default)."
            )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "sync_ref_model=True moves the reference during training, but precompute_ref_log_probs=True "
                "scores the examples with it once, before training. Use one of the two."
            )
        if self.precompute_ref_log_probs and self.uses_kl and self.train_sampling_strategy != "sequential":
            warnings.warn(
                "precompute_ref_log_probs=True with loss_type='kto' fixes the KL pairs before training: each "
                "example is paired with the previous one of its chunk of per_device_train_batch_size rows. With "
                f"train_sampling_strategy={self.train_sampling_strategy!r} the micro-batches are other rows, so the "
                "pairs no longer come from the micro-batch (the estimate stays a mismatched-pair one). Set "
                "train_sampling_strategy='sequential' to keep them in the batch.",
                UserWarning,
                stacklevel=4,
            )

    @property
    def uses_kl(self) -> bool:
        """Whether the loss type needs the KL estimate (and so mismatched pairs)."""
        return losses.LOSS_TYPES[self.loss_type].uses_kl
