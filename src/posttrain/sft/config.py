"""Configuration of the SFT trainer: ``SFTConfig``, a drop-in for ``trl.SFTConfig`` (TRL 1.16).

Only SFT's own fields are declared here; the shared ones (``model_init_kwargs``,
``trust_remote_code``, the changed ``TrainingArguments`` defaults) and the validation
machinery come from ``core.config.BaseConfig``.
"""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import OfflineConfig, Rule, UnbuiltOption, choice_rules
from posttrain.data.packing import PACKING_STRATEGIES
from posttrain.sft.losses import DEPRECATED_LOSS_TYPES, LOSS_TYPES

__all__ = ["SFTConfig"]

#: Allowed values of the string-valued choice parameters.
CHOICES: dict[str, tuple[str, ...]] = {
    "truncation_mode": ("keep_start", "keep_end"),
    "packing_strategy": (*PACKING_STRATEGIES, "bfd-requeue"),
    "loss_type": (*LOSS_TYPES, *DEPRECATED_LOSS_TYPES),
}

# fmt: off
_RULES: tuple[Rule, ...] = OfflineConfig._rules + (
    Rule("dataset_kwargs", lambda v: v is None or (isinstance(v, dict) and set(v) <= {"skip_prepare_dataset"}), "None or a dict whose only key is 'skip_prepare_dataset'", "pass dataset_kwargs={'skip_prepare_dataset': True} for an already tokenised dataset, or leave it None"),
) + choice_rules(CHOICES)
# fmt: on

UNBUILT_OPTIONS: dict[str, UnbuiltOption] = {}


@dataclass
class SFTConfig(OfflineConfig):
    r"""Configuration of :class:`~posttrain.SFTTrainer`, a drop-in for ``trl.SFTConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`model_init_kwargs`, `trust_remote_code`, and `logging_steps=10`,
    `gradient_checkpointing=True`, `bf16=None`), and the SFT parameters below.

    TrainingArguments default changed for SFT:
        learning_rate (`float`, defaults to `2e-5` instead of `5e-5`): Initial learning rate.

    Model:
        router_aux_loss_coef (`float | None`, defaults to `None`): Weight of the load-balancing
            auxiliary loss of Mixture-of-Experts models; `None` uses the model config's value.
            Only valid for MoE models.
        chat_template_path (`str | None`, defaults to `None`): The chat template to train with: a
            Jinja file (`.jinja`, `.j2`), or a tokenizer (folder or hub id) whose template, EOS
            token and template tokens are taken (the embeddings grow for tokens added).

    Data:
        dataset_text_field (`str`, defaults to `"text"`): The column of language-modelling text.
        dataset_kwargs (`dict[str, Any] | str | None`, defaults to `None`): Only
            `{"skip_prepare_dataset": True}`: the dataset is already tokenised (`input_ids`, and
            optionally `completion_mask`, `assistant_masks` or `labels`) and is used as it is.
        dataset_num_proc (`int | None`, defaults to `None`): Worker processes for tokenising.
        eos_token (`str | None`, defaults to `None`): The token appended to texts and
            completions; `None` uses the tokenizer's EOS token.
        max_length (`int | None`, defaults to `1024`): The most tokens of a row (of a packed
            bin with `packing`); longer rows are truncated. `None`: no truncation.
        truncation_mode (`str`, defaults to `"keep_start"`): `"keep_start"` or `"keep_end"`.
        shuffle_dataset (`bool`, defaults to `False`): Shuffle the training dataset once, before
            packing.
        packing (`bool`, defaults to `False`): Pack several rows into each row of up to
            `max_length` tokens; the sequences never attend to each other.
        packing_strategy (`str`, defaults to `"bfd"`): `"bfd"` (best-fit decreasing, over-long
            rows truncated), `"bfd_split"` (over-long rows split first; `"bfd-requeue"` is its
            old name) or `"wrapped"` (concatenate and cut every `max_length`).
        padding_free (`bool`, defaults to `False`): Lay each batch's rows end to end without
            padding, told apart by their position ids.
        pad_to_multiple_of (`int | str | None`, defaults to `"auto"`): Pad each batch to a
            multiple of this many tokens; `"auto"` means 128 on AWS Neuron and no padding
            elsewhere.
        eval_packing (`bool | None`, defaults to `None`): Pack the eval dataset; `None` follows
            `packing`.

    Loss:
        completion_only_loss (`bool | None`, defaults to `None`): Train only on the completion
            tokens of prompt-completion rows; `None` means on for prompt-completion data.
        assistant_only_loss (`bool`, defaults to `False`): Train only on the assistant turns of
            conversations (needs a chat template with generation markers).
        loss_type (`str`, defaults to `"nll"`): `"nll"` (cross-entropy) or `"dft"` (Dynamic
            Fine-Tuning: each token's loss weighted by its probability). `"chunked_nll"` is a
            deprecated name of `"nll"`.
        activation_offloading (`bool`, defaults to `False`): Move the activations saved for
            backward from the accelerator to CPU memory. Needs an accelerator.
        pad_token (`str | None`, defaults to `None`): Deprecated: set the tokenizer's pad token.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = UNBUILT_OPTIONS
    _json_dict_fields: ClassVar[tuple[str, ...]] = ("model_init_kwargs", "dataset_kwargs")

    learning_rate: float = field(
        default=2e-5, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "A Jinja template file, or a tokenizer whose chat template to train with."},
    )
    dataset_text_field: str = field(
        default="text", metadata={"help": "The column of language-modelling text."}
    )
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Only {'skip_prepare_dataset': True}: the dataset is already tokenised (JSON accepted)."
        },
    )
    eos_token: str | None = field(
        default=None, metadata={"help": "Token appended to texts and completions; None: the tokenizer's EOS."}
    )
    truncation_mode: str = field(default="keep_start", metadata={"help": "'keep_start' or 'keep_end'."})
    shuffle_dataset: bool = field(default=False, metadata={"help": "Shuffle the training dataset once."})
    packing: bool = field(
        default=False, metadata={"help": "Pack several rows into each row of max_length tokens."}
    )
    packing_strategy: str = field(default="bfd", metadata={"help": "'bfd', 'bfd_split' or 'wrapped'."})
    padding_free: bool = field(
        default=False, metadata={"help": "Lay each batch's rows end to end, no padding."}
    )
    eval_packing: bool | None = field(
        default=None, metadata={"help": "Pack the eval dataset; None follows packing."}
    )
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Train only on completions; None: on for prompt-completion data."}
    )
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "Train only on the assistant turns (needs generation markers)."}
    )
    loss_type: str = field(default="nll", metadata={"help": "'nll' or 'dft' (Dynamic Fine-Tuning)."})

    def _normalise_family(self) -> None:
        """The shared normalisations, then the old name of ``bfd_split``."""
        super()._normalise_family()
        if self.packing_strategy == "bfd-requeue":
            self.packing_strategy = "bfd_split"

    def _check_combinations(self) -> None:
        if self.packing and self.max_length is None:
            raise ValueError(
                "packing=True fills rows of max_length tokens, but max_length=None; set max_length (e.g. 1024)."
            )
        super()._check_combinations()

    def _derive(self) -> None:
        super()._derive()
        if self.eval_packing is None:
            self.eval_packing = self.packing
