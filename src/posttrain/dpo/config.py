"""Configuration of the DPO trainer: ``DPOConfig``, a drop-in for ``trl.DPOConfig`` (TRL 1.16).

Only DPO's own fields are declared here. The fields the offline trainers share (``max_length``,
``pad_to_multiple_of``, ``dataset_num_proc``, ``activation_offloading``, ``pad_token``,
``router_aux_loss_coef``) and the validation machinery come from ``core.config``; the valid
loss types and f-divergences come from the loss table of ``dpo/losses.py``.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import OfflineConfig, Rule, choice_rules, optional, positive_int
from posttrain.dpo import losses

__all__ = ["DPOConfig"]

CHOICES: dict[str, tuple[str, ...]] = {"truncation_mode": ("keep_start", "keep_end")}

# fmt: off
_RULES: tuple[Rule, ...] = OfflineConfig._rules + (
    Rule("beta", lambda v: isinstance(v, (int, float)) and v > 0, "a positive number", "set beta to a positive number such as 0.1"),
    Rule("precompute_ref_batch_size", optional(positive_int), "None or a positive integer", "set precompute_ref_batch_size to a batch size, or leave it None"),
    Rule("ref_model_sync_steps", positive_int, "a positive integer", "set ref_model_sync_steps to 1 or more (512 by default)"),
    Rule("ref_model_mixup_alpha", lambda v: isinstance(v, (int, float)) and 0 <= v <= 1, "a number in [0, 1]", "set ref_model_mixup_alpha between 0 and 1 (0.6 by default)"),
    Rule("discopop_tau", lambda v: isinstance(v, (int, float)) and v > 0, "a positive number", "set discopop_tau to a positive number such as 0.05"),
) + choice_rules(CHOICES)
# fmt: on


@dataclass
class DPOConfig(OfflineConfig):
    r"""Configuration of :class:`~posttrain.DPOTrainer`, a drop-in for ``trl.DPOConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`max_length=1024`, `pad_to_multiple_of="auto"`, `dataset_num_proc`,
    `activation_offloading`, `pad_token`, `router_aux_loss_coef`, `model_init_kwargs`,
    `trust_remote_code`, `logging_steps=10`, `gradient_checkpointing=True`, `bf16=None`) and
    the DPO parameters below.

    TrainingArguments default changed for DPO:
        learning_rate (`float`, defaults to `1e-6` instead of `5e-5`): Initial learning rate.

    Model:
        disable_dropout (`bool`, defaults to `True`): Turn dropout off in the policy (and the
            reference).

    Data:
        truncation_mode (`str`, defaults to `"keep_start"`): `"keep_start"` keeps the start of
            prompt + completion; `"keep_end"` is deprecated (as in the reference).
        padding_free (`bool`, defaults to `False`): Lay a batch's sequences end to end in one
            row, without padding, when the model's attention is flash-attention (varlen); with
            eager or SDPA attention the batch keeps its prompts-once layout (a block mask over one
            packed row would cost more than the padding). The losses are the same either way. The
            reference warns and pads instead.

    Reference:
        precompute_ref_log_probs (`bool`, defaults to `False`): Score the training pairs with
            the reference once before training and keep no reference model while training.
        precompute_ref_batch_size (`int | None`, defaults to `None`): Pairs scored at once when
            precomputing; `None` uses `per_device_train_batch_size`.
        sync_ref_model (`bool`, defaults to `False`): TR-DPO: mix the policy into the reference
            every `ref_model_sync_steps` steps, `ref <- alpha * policy + (1 - alpha) * ref`.
        ref_model_mixup_alpha (`float`, defaults to `0.6`): TR-DPO's alpha.
        ref_model_sync_steps (`int`, defaults to `512`): TR-DPO's tau.

    Loss:
        loss_type (`list[str]`, defaults to `["sigmoid"]`): One loss or several (summed with
            `loss_weights`); names in `dpo.losses.LOSS_TYPES`: sigmoid, hinge, ipo, exo_pair,
            nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
            discopop, sft, sigmoid_norm, udpo.
        loss_weights (`list[float] | None`, defaults to `None`): One weight per loss type; `None`
            weighs each 1.0.
        beta (`float`, defaults to `0.1`): The inverse temperature of the implicit reward.
        label_smoothing (`float`, defaults to `0.0`): The assumed rate of flipped labels
            (conservative DPO, robust, exo_pair, aot, udpo).
        f_divergence_type (`str`, defaults to `"reverse_kl"`): `"reverse_kl"`, `"forward_kl"`,
            `"js_divergence"` or `"alpha_divergence"` (f-DPO).
        f_alpha_divergence_coef (`float`, defaults to `0.5`): The alpha of the alpha divergence.
        use_weighting (`bool`, defaults to `False`): WPO: weigh each pair by the policy's
            length-normalised probability of its completions.
        ld_alpha (`float | None`, defaults to `None`): LD-DPO: weight of the log-probs of the
            completion tokens past the shorter completion's length.
        discopop_tau (`float`, defaults to `0.05`): DiscoPOP's temperature.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _RULES

    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Turn dropout off in the policy and the reference."}
    )
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "'keep_start' ('keep_end' is deprecated)."}
    )
    padding_free: bool = field(
        default=False, metadata={"help": "Padding-free batches (with flash-attention)."}
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Score the pairs with the reference once, before training."}
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Pairs scored at once when precomputing; None: the train batch size."}
    )
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"One or more of {', '.join(losses.LOSS_TYPES)}."},
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss type; None weighs each 1.0."}
    )
    ld_alpha: float | None = field(
        default=None, metadata={"help": "LD-DPO: weight of the log-probs past the shorter completion."}
    )
    f_divergence_type: str = field(
        default="reverse_kl", metadata={"help": f"One of {', '.join(losses.F_DIVERGENCE_TYPES)}."}
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, metadata={"help": "The alpha of the alpha divergence."}
    )
    label_smoothing: float = field(
        default=0.0, metadata={"help": "The assumed rate of flipped preference labels."}
    )
    beta: float = field(default=0.1, metadata={"help": "Inverse temperature of the implicit reward."})
    use_weighting: bool = field(default=False, metadata={"help": "WPO weights on each pair."})
    discopop_tau: float = field(default=0.05, metadata={"help": "DiscoPOP's temperature."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: mix the policy into the reference."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO's alpha."})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO: steps between reference syncs."}
    )

    def _normalise_family(self) -> None:
        """A single loss type given as a string becomes a one-item list."""
        super()._normalise_family()
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        else:
            self.loss_type = list(self.loss_type)

    def _check_combinations(self) -> None:
        super()._check_combinations()
        types, _ = losses.check_loss_settings(
            self.loss_type,
            self.loss_weights,
            self.f_divergence_type,
            self.label_smoothing,
            self.ld_alpha,
            self.use_weighting,
        )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "sync_ref_model=True moves the reference during training, but precompute_ref_log_probs=True "
                "scores the pairs with it once, before training. Use one of the two."
            )

    @staticmethod
    def uses_reference(loss_types: list[str]) -> bool:
        """Whether any of the loss types compares the policy with a reference model."""
        return any(losses.LOSS_TYPES[name].uses_reference for name in loss_types)
