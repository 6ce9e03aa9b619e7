"""Configuration of the ORPO trainer: ``ORPOConfig``, a drop-in for ``trl.experimental.orpo.ORPOConfig``.

Also ``ReferenceFreeConfig``, the fields ORPO and CPO share (TRL 1.16 declares them in each of
its two configs): the learning rate, ``max_length=None`` meaning 512, the encoder-decoder and
generation options that are not built, and ``warmup_ratio``, which transformers 5 removed and
the papers' configurations still pass. ``CPOConfig`` extends it.
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import OfflineConfig, Rule, UnbuiltOption, is_int, is_num, optional

__all__ = ["ORPOConfig", "ReferenceFreeConfig"]

#: What ``max_length=None`` stands for in ORPO and CPO, as in the reference.
DEFAULT_MAX_LENGTH = 512

# fmt: off
_SHARED_RULES: tuple[Rule, ...] = OfflineConfig._rules + (
    Rule("warmup_ratio", optional(lambda v: is_num(v) and 0 <= v < 1), "None or a number in [0, 1)", "set warmup_ratio to the share of the training steps that warm up, such as 0.01, or use warmup_steps"),
    Rule("is_encoder_decoder", lambda v: v is None or isinstance(v, bool), "None, True or False", "leave is_encoder_decoder None (causal language models)"),
)
_ORPO_RULES: tuple[Rule, ...] = _SHARED_RULES + (
    Rule("beta", lambda v: is_num(v) and v >= 0 and v != float("inf"), "a finite number >= 0", "set beta (ORPO's λ, the weight of the odds-ratio term) to a number such as 0.1"),
    Rule("padding_value", optional(lambda v: is_int(v) and v >= 0), "None or a token id (an integer >= 0)", "leave padding_value None to pad with the tokenizer's pad token"),
)
# fmt: on

UNBUILT_OPTIONS: dict[str, UnbuiltOption] = {
    "max_completion_length": UnbuiltOption(
        None,
        "encoder-decoder models, whose decoder side max_completion_length bounds",
        "Leave max_completion_length=None: posttrain trains causal language models, whose prompt + completion "
        "max_length bounds.",
        128,
    ),
    "is_encoder_decoder": UnbuiltOption(
        None,
        "encoder-decoder models",
        "Leave is_encoder_decoder None (or False): posttrain trains causal language models.",
        True,
        unbuilt_if=lambda v: v is True,
    ),
    "generate_during_eval": UnbuiltOption(
        False,
        "sampling completions during evaluation",
        "Set generate_during_eval=False; the evaluation's loss and metrics are logged with an eval_ prefix.",
        True,
    ),
}


@dataclass
class ReferenceFreeConfig(OfflineConfig):
    """The fields ORPO and CPO share; ``ORPOConfig`` and ``CPOConfig`` extend it.

    TrainingArguments default changed:
        learning_rate (`float`, defaults to `1e-6` instead of `5e-5`): Initial learning rate.

    Args:
        max_length (`int | None`, defaults to `1024`): The most tokens of prompt + completion
            per side (chosen and rejected each keep their first `max_length` tokens; a pair whose
            prompt alone fills them is dropped). `None` means 512, with a warning, as in the
            reference.
        max_completion_length (`int | None`, defaults to `None`): Encoder-decoder models only:
            not built (`NotImplementedError` when set).
        disable_dropout (`bool`, defaults to `True`): Turn dropout off in the model.
        generate_during_eval (`bool`, defaults to `False`): Not built (`NotImplementedError`).
        is_encoder_decoder (`bool | None`, defaults to `None`): `True` is not built
            (`NotImplementedError`); posttrain trains causal language models.
        warmup_ratio (`float | None`, defaults to `None`): The share of the training steps that
            warm the learning rate up, in [0, 1). transformers 5 removed it; it is passed on as
            `warmup_steps` (which transformers 5 reads as a share of the steps below 1), so the
            papers' configurations run as written. Give it or `warmup_steps`, not both.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _SHARED_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = UNBUILT_OPTIONS

    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Encoder-decoder models only (not built)."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})
    generate_during_eval: bool = field(
        default=False, metadata={"help": "Sample completions during evaluation (not built)."}
    )
    is_encoder_decoder: bool | None = field(
        default=None, metadata={"help": "True is not built: posttrain trains causal language models."}
    )

    def _normalise_family(self) -> None:
        """``max_length=None`` becomes 512, with a warning, as in the reference."""
        super()._normalise_family()
        if self.max_length is None:
            warnings.warn(
                f"{type(self).__name__}(max_length=None) uses max_length={DEFAULT_MAX_LENGTH} tokens, as the reference "
                "does; set max_length yourself to silence this warning.",
                UserWarning,
                stacklevel=4,
            )
            self.max_length = DEFAULT_MAX_LENGTH


@dataclass
class ORPOConfig(ReferenceFreeConfig):
    r"""Configuration of :class:`~posttrain.ORPOTrainer`, a drop-in for ``trl.experimental.orpo.ORPOConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`pad_to_multiple_of="auto"`, `dataset_num_proc`, `activation_offloading`,
    `pad_token`, `router_aux_loss_coef`, `model_init_kwargs`, `trust_remote_code`,
    `logging_steps=10`, `gradient_checkpointing=True`, `bf16=None`), those of
    ``ReferenceFreeConfig`` (`learning_rate=1e-6`, `max_length=1024`, `max_completion_length`,
    `disable_dropout=True`, `generate_during_eval`, `is_encoder_decoder`, `warmup_ratio`) and:

    Args:
        beta (`float`, defaults to `0.1`): λ, the weight of the odds-ratio term (`orpo/losses.py`);
            0 trains the chosen completions' NLL alone.
        padding_value (`int | None`, defaults to `None`): The token id that pads the batches;
            `None` uses the tokenizer's pad token.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _ORPO_RULES

    beta: float = field(default=0.1, metadata={"help": "λ, the weight of the odds-ratio term."})
    padding_value: int | None = field(
        default=None, metadata={"help": "Token id that pads the batches; None: the tokenizer's pad token."}
    )
