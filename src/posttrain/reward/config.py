"""Configuration of the reward trainer: ``RewardConfig``, a drop-in for ``trl.RewardConfig`` (TRL 1.16).

Only reward modelling's own fields are declared here. The fields the offline trainers share
(``max_length``, ``pad_to_multiple_of``, ``dataset_num_proc``, ``activation_offloading``,
``pad_token``) and the validation machinery come from ``core.config``.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import OfflineConfig, Rule, UnbuiltOption, is_num, optional

__all__ = ["RewardConfig"]

# fmt: off
_RULES: tuple[Rule, ...] = OfflineConfig._rules + (
    Rule("center_rewards_coefficient", optional(lambda v: is_num(v) and 0 <= v < float("inf")), "None or a non-negative number", "set center_rewards_coefficient to a small weight such as 0.01 (arXiv 2312.09244), or leave it None"),
    Rule("eos_token", optional(lambda v: isinstance(v, str) and v != ""), "None or a token of the tokenizer (a non-empty string)", "set eos_token to the token appended to standard texts, or leave it None for the tokenizer's EOS token"),
    Rule("chat_template_path", optional(lambda v: isinstance(v, str) and v != ""), "None or a path", "set chat_template_path to a '.jinja' file or a tokenizer folder or hub id, or leave it None"),
)
# fmt: on

UNBUILT_OPTIONS: dict[str, UnbuiltOption] = {
    "router_aux_loss_coef": UnbuiltOption(
        None,
        "the Mixture-of-Experts load-balancing loss of sequence classifiers",
        "Leave router_aux_loss_coef None: transformers' sequence classifiers return no router loss to weigh.",
        0.001,
    ),
}


@dataclass
class RewardConfig(OfflineConfig):
    r"""Configuration of :class:`~posttrain.RewardTrainer`, a drop-in for ``trl.RewardConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`dataset_num_proc`, `pad_to_multiple_of="auto"`, `activation_offloading`,
    `pad_token` (deprecated), `model_init_kwargs`, `trust_remote_code`, `logging_steps=10`,
    `gradient_checkpointing=True`, `bf16=None`) and the reward modelling parameters below.

    TrainingArguments default changed for reward modelling:
        learning_rate (`float`, defaults to `1e-4` instead of `5e-5`): Initial learning rate.

    Model:
        model_init_kwargs (`dict | str | None`, defaults to `None`): Keyword arguments for
            `AutoModelForSequenceClassification.from_pretrained` when the model is given by
            name; `num_labels` is always 1 (another value is an error).
        chat_template_path (`str | None`, defaults to `None`): The chat template to train with:
            a `.jinja` file, or a tokenizer folder or hub id whose template (and the special
            tokens it writes) is taken.
        disable_dropout (`bool`, defaults to `True`): Turn dropout off in the model.

    Data:
        eos_token (`str | None`, defaults to `None`): The token appended to standard texts;
            `None` uses the tokenizer's EOS token. Must be a token of the tokenizer.
        max_length (`int | None`, defaults to `1024`): Pairs with a chosen or a rejected
            sequence longer than this many tokens are dropped (not truncated), with a warning
            giving the count; `None` keeps every pair.

    Loss:
        center_rewards_coefficient (`float | None`, defaults to `None`): η of the centering
            term `η * mean((r_chosen + r_rejected)^2)` that keeps rewards near zero
            (arXiv 2312.09244, Eq. 2); 0.01 is the recommended value.

    Not built:
        router_aux_loss_coef: must stay `None` (`NotImplementedError`): sequence classifiers
            return no load-balancing loss.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = UNBUILT_OPTIONS

    learning_rate: float = field(
        default=1e-4, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "A '.jinja' chat template, or a tokenizer whose template to train with."},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Pairs with a side longer than this many tokens are dropped (not truncated); None keeps all."
        },
    )
    eos_token: str | None = field(
        default=None, metadata={"help": "Token appended to standard texts; None: the tokenizer's EOS token."}
    )
    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "Weight of mean((r_chosen + r_rejected)^2), which centres the rewards; e.g. 0.01."},
    )
