"""The base configuration every trainer's config extends: ``BaseConfig``.

It holds what the reference's configs share (the changed ``TrainingArguments`` defaults, model
loading options) and the validation machinery: a table of rules, one row per parameter
(``Rule``); a table of options that are accepted but not built yet (``UnbuiltOption``), which
raise ``NotImplementedError`` naming the option; JSON-object strings from the command line
parsed into dicts; and ``bf16=None`` resolved for the machine. A family's config declares only
its own fields, its rules and its unbuilt options, and, where it needs them, the hooks
``_normalise_family``, ``_check_combinations`` and ``_derive``.

Order of ``__post_init__``: cheap normalisation and checks first (so a bad value fails before
``TrainingArguments`` sets up the distributed state), then ``TrainingArguments``'s own setup,
then the values that depend on the world size.
"""

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from posttrain.models.compat import HAS_ACTIVATION_CHECKPOINTING, checkpointing_enabled
from posttrain.ops.precision import native_bf16

__all__ = [
    "FAMILY_OPTIONS",
    "BaseConfig",
    "Rule",
    "UnbuiltOption",
    "choice_rules",
    "family_option",
    "is_int",
    "is_num",
    "optional",
    "positive_int",
]


@dataclass(frozen=True)
class UnbuiltOption:
    """One option that a config accepts but posttrain does not implement yet.

    Attributes:
        default: The value that works today (the spec default).
        feature: Name of the planned feature, quoted in the error message.
        fix: One sentence telling the user how to get a working config now.
        example: A value that needs the missing feature (the tests set it).
        unbuilt_if: Predicate on the value; when omitted, any value other than ``default``.
    """

    default: Any
    feature: str
    fix: str
    example: Any
    unbuilt_if: Callable[[Any], bool] | None = None

    def is_unbuilt(self, value: Any) -> bool:
        """Whether ``value`` needs the missing feature."""
        if self.unbuilt_if is not None:
            return self.unbuilt_if(value)
        return value != self.default


@dataclass(frozen=True)
class Rule:
    """A constraint on one parameter: ``name`` must satisfy ``ok``; otherwise say ``must``/``fix``."""

    name: str
    ok: Callable[[Any], bool]
    must: str
    fix: str


def is_num(v: Any) -> bool:
    """Whether ``v`` is an int or a float that is neither a bool nor NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def is_int(v: Any) -> bool:
    """Whether ``v`` is an integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Wrap ``check`` so that ``None`` also passes."""
    return lambda v: v is None or check(v)


def positive_int(v: Any) -> bool:
    """Whether ``v`` is an integer >= 1."""
    return is_int(v) and v >= 1


def choice_rules(choices: dict[str, tuple[str, ...]]) -> tuple[Rule, ...]:
    """One rule per string-valued choice parameter: its value must be one of the allowed ones."""
    return tuple(
        Rule(
            name,
            lambda v, allowed=allowed: v in allowed,
            "one of " + ", ".join(repr(a) for a in allowed),
            "use one of the listed values",
        )
        for name, allowed in choices.items()
    )


def parse_json_dict(name: str, value: Any) -> Any:
    """Turn a JSON object string (as given on the command line) into a dict; pass others through."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{name}={value!r} is not valid JSON ({err.msg}); pass a dict or a JSON object string "
            "such as '{\"key\": 1}'."
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"{name}={value!r} is JSON but not an object; pass a dict or a JSON object string "
            "such as '{\"key\": 1}'."
        )
    return parsed


def cpu_bf16_warning() -> str:
    """What ``bf16=None`` resolving to True under ``use_cpu=True`` means on this CPU, and the way out."""
    start = "bf16=None resolved to True with use_cpu=True, so the model runs under CPU bfloat16 autocast. "
    if native_bf16():
        speed = (
            "This CPU has bf16 instructions: a GRPO step measured about 0.7x to 0.9x of float32's on such "
            "hosts (AMD EPYC with AVX512-BF16, Intel Xeon with AMX), with bf16's rounding in the log-probs"
        )
    else:
        speed = (
            "This CPU has no bf16 instructions (AVX512-BF16 or AMX), so bf16 products are emulated and "
            "training runs several times slower than in float32"
        )
    return f"{start}{speed} (BENCHMARKS.md, 'bf16 on the CPU'). Pass bf16=False to train in float32."


def bf16_supported(use_cpu: bool) -> bool:
    """Whether ``TrainingArguments`` will accept ``bf16=True`` on this machine."""
    return use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available()


#: Fields the base config adds to every reference config (features the reference lost or lacks).
BASE_EXTENSIONS = ("warmup_ratio",)

#: The fields the core reads that only some families' configs declare, with what their absence
#: means. The reference's configs differ here (SFT has no reference model to sync, the reward
#: trainer no dropout switch), so these stay off ``BaseConfig``, whose field list each family's
#: config would otherwise gain; the core reads them through ``family_option`` and reads no other
#: field ``BaseConfig`` does not declare (``tests/test_layering.py``).
FAMILY_OPTIONS: dict[str, Any] = {
    "disable_dropout": False,  # GRPO, DPO, KTO, ... switch the policy's (and reference's) dropout off
    "cast_lm_head_to_fp32": False,  # the online families' and SFT's float32 output head
    "sync_ref_model": False,  # TR-DPO: with it, ref_model_sync_steps and ref_model_mixup_alpha
    "router_aux_loss_coef": None,  # OfflineConfig's and OnlineConfig's MoE router loss weight
    "activation_offloading": False,  # the configs that offer offloading the saved activations
    # read only when sync_ref_model is set, so by a config that declares them with it:
    "ref_model_sync_steps": None,
    "ref_model_mixup_alpha": None,
}


def family_option(args: Any, name: str) -> Any:
    """The ``FAMILY_OPTIONS`` field ``name`` of a config, or what its absence means.

    Raises:
        KeyError: ``name`` is not a ``FAMILY_OPTIONS`` field (declare it on ``BaseConfig`` instead).
    """
    return getattr(args, name, FAMILY_OPTIONS[name])


@dataclass
class BaseConfig(TrainingArguments):
    """What every posttrain config shares; a family's config subclasses it.

    TrainingArguments defaults changed, as in every config of the reference:
        logging_steps (`float`, defaults to `10` instead of `500`).
        gradient_checkpointing (`bool`, defaults to `True` instead of off), handed to
            `activation_checkpointing`, its transformers 5 name, unless that one is set.
        bf16 (`bool | None`, defaults to `None` instead of `False`): `None` resolves to `True`
            unless `fp16=True`; on a machine that cannot run bfloat16 without `use_cpu=True` it
            resolves to `False` instead.

    Shared fields:
        model_init_kwargs (`dict[str, Any] | str | None`, defaults to `None`): Keyword arguments
            for `from_pretrained` when the trainer's `model` is given as a string (a dict, or a
            JSON object string from the command line).
        trust_remote_code (`bool`, defaults to `False`): Allow models and tokenizers that ship
            custom Python code.

    TrainingArguments fields that take more:
        gradient_checkpointing_kwargs (`dict | str | None`, defaults to `None`): also takes
            `"selective": True`, selective activation checkpointing (SAC, arXiv 2205.05198), as in
            the reference: checkpointed layers keep the output of their fused attention op (SDPA,
            flash, flex attention) and recompute the rest in backward. Needs
            `gradient_checkpointing=True` and non-reentrant checkpointing (no `use_reentrant=True`).
            With `attn_implementation="eager"` nothing is saved and the trainer warns. The key
            works in `activation_checkpointing_kwargs` too (`posttrain.ops.sac`; not the CPU's
            `POSTTRAIN_SELECTIVE_CHECKPOINTING`, which it combines with).
    """

    #: Rules checked first, one row per parameter.
    _rules: ClassVar[tuple[Rule, ...]] = ()
    #: Options accepted but not built yet; building a feature deletes its row.
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = {}
    #: Parameters that take a dict and may arrive as a JSON object string.
    _json_dict_fields: ClassVar[tuple[str, ...]] = ("model_init_kwargs",)

    if not HAS_ACTIVATION_CHECKPOINTING:  # transformers < 5.20 knows only gradient_checkpointing*
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": "Recompute activations in the backward pass; None follows gradient_checkpointing "
                "(transformers 5's name, routed to gradient_checkpointing on older releases)."
            },
        )
        activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
            default=None,
            metadata={
                "help": "Keyword arguments of activation checkpointing (None: gradient_checkpointing_kwargs)."
            },
        )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass to save memory (slower steps)."},
    )
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every this many steps; a value below 1 is a fraction of the total steps."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "Train in bfloat16 mixed precision. None means True unless fp16 is set."},
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments (a dict or a JSON object string) for from_pretrained when the "
            "model is given by name; its revision also selects the processing class."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow loading models, reward models and tokenizers that ship custom Python code."},
    )
    warmup_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Share of the steps that warm up, in [0, 1); passed on as warmup_steps (transformers 5 "
            "removed warmup_ratio and reads a warmup_steps below 1 as that share)."
        },
    )

    def __post_init__(self) -> None:
        """Normalise, validate, set up ``TrainingArguments``, then derive the family's values.

        Raises:
            ValueError: A parameter has an invalid value or an invalid combination.
            NotImplementedError: An option that posttrain does not build yet is set.
        """
        for name in self._json_dict_fields:
            setattr(self, name, parse_json_dict(name, getattr(self, name)))
        self._normalise_family()
        for rule in self._rules:
            value = getattr(self, rule.name)
            if not rule.ok(value):
                raise ValueError(f"{rule.name}={value!r} is invalid: it must be {rule.must}; {rule.fix}.")
        self._check_combinations()
        self._apply_warmup_ratio()
        self._check_selective_checkpointing()
        self._reject_unbuilt_options()
        self._resolve_changed_defaults()
        super().__post_init__()
        if not HAS_ACTIVATION_CHECKPOINTING:  # as transformers 5.20+ does: both names hold the value
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        self._derive()

    def _apply_warmup_ratio(self) -> None:
        """Pass ``warmup_ratio`` on as a fractional ``warmup_steps``, so the papers' configs run as written.

        A config rebuilt from its own values (``warmup_steps`` already equal to ``warmup_ratio``,
        e.g. ``dataclasses.replace``) passes.

        Raises:
            ValueError: ``warmup_ratio`` outside [0, 1), or with a different non-zero ``warmup_steps``.
        """
        if self.warmup_ratio is None:
            return
        ratio = self.warmup_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(
                f"warmup_ratio={ratio!r} is invalid: it must be None or a number in [0, 1); give the share of the "
                "training steps that warm the learning rate up, such as 0.1, or use warmup_steps."
            )
        if self.warmup_steps and self.warmup_steps != ratio:
            raise ValueError(
                f"warmup_ratio={ratio} and warmup_steps={self.warmup_steps} are both set; give one of "
                "them (warmup_ratio is passed on as a fractional warmup_steps, transformers 5's form)."
            )
        self.warmup_steps = float(ratio)

    # ---- hooks of a family's config ------------------------------------------------------------

    def _normalise_family(self) -> None:
        """Map aliases and deprecated parameters to their current form (before any check)."""

    def _check_combinations(self) -> None:
        """Raise on combinations of values that cannot work (after the per-parameter rules)."""

    def _derive(self) -> None:
        """Fill the values that depend on the world size (after ``TrainingArguments``'s setup)."""

    # ---- the shared steps ------------------------------------------------------------------------

    def _check_selective_checkpointing(self) -> None:
        """Check ``gradient_checkpointing_kwargs={"selective": True}`` (selective activation checkpointing).

        SAC (``ops/sac.py``) saves the attention ops' outputs in checkpointed layers; it needs
        checkpointing on and torch's non-reentrant checkpoint. The key stays in the kwargs: the
        trainer turns it into the checkpoint's ``context_fn`` once checkpointing is enabled.

        Raises:
            ValueError: ``selective`` is not a bool, or it is True with checkpointing off, with
                ``use_reentrant=True`` or with a ``context_fn`` of its own.
        """
        # Read the values as TrainingArguments will resolve them: the transformers 5 names win.
        name = "gradient_checkpointing_kwargs"
        kwargs = self.gradient_checkpointing_kwargs
        if getattr(self, "activation_checkpointing_kwargs", None) is not None:
            name, kwargs = "activation_checkpointing_kwargs", self.activation_checkpointing_kwargs
        if isinstance(kwargs, str) and kwargs.lstrip().startswith("{"):
            kwargs = parse_json_dict(name, kwargs)
        if not isinstance(kwargs, dict) or "selective" not in kwargs:
            return
        selective = kwargs["selective"]
        if not isinstance(selective, bool):
            raise ValueError(
                f"{name}['selective']={selective!r} is invalid: it must be True or False; set it to True for "
                "selective activation checkpointing (the attention outputs are kept, the rest is recomputed)."
            )
        if not selective:
            return
        if not checkpointing_enabled(self):
            raise ValueError(
                f"{name}={{'selective': True}} (selective activation checkpointing) needs gradient_checkpointing=True, "
                "but checkpointing is off (gradient_checkpointing=False, or activation_checkpointing=False). "
                f"Set gradient_checkpointing=True, or remove 'selective' from {name}."
            )
        if kwargs.get("use_reentrant"):
            raise ValueError(
                f"{name}={{'selective': True, 'use_reentrant': True}}: selective activation checkpointing runs on "
                f"torch's non-reentrant checkpoint only. Drop 'use_reentrant' from {name} or set it to False."
            )
        if kwargs.get("context_fn") is not None:
            raise ValueError(
                f"{name} has both 'selective' and 'context_fn'; selective activation checkpointing brings its own "
                "context_fn. Remove one of them."
            )

    def _reject_unbuilt_options(self) -> None:
        """Raise ``NotImplementedError`` listing every unbuilt option in use."""
        problems = [
            f"{name}={getattr(self, name)!r} is not implemented yet in posttrain "
            f"(planned: {row.feature}). {row.fix}"
            for name, row in self._unbuilt.items()
            if row.is_unbuilt(getattr(self, name))
        ]
        if problems:
            raise NotImplementedError("\n".join(problems))

    def _resolve_changed_defaults(self) -> None:
        """Resolve ``bf16=None`` and route ``gradient_checkpointing`` without a deprecation warning."""
        if self.bf16 is None:
            self.bf16 = not self.fp16 and bf16_supported(self.use_cpu)
            if self.bf16 and self.use_cpu:
                warnings.warn(cpu_bf16_warning(), UserWarning, stacklevel=4)
        # transformers 5.20+ treats `gradient_checkpointing` as a deprecated alias of
        # `activation_checkpointing` and warns whenever it is set; the reference sets it by
        # default, so hand the value over to the new name unless the user chose that one.
        # Older releases act on `gradient_checkpointing*` only: the new names, which this config
        # declares for them, are handed over the other way, so both spellings work on both.
        if HAS_ACTIVATION_CHECKPOINTING:
            if self.activation_checkpointing is None:
                self.activation_checkpointing = self.gradient_checkpointing
            return
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing
        else:
            self.gradient_checkpointing = self.activation_checkpointing
        if self.activation_checkpointing_kwargs is not None and self.gradient_checkpointing_kwargs is None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs


# fmt: off
_OFFLINE_RULES: tuple[Rule, ...] = (
    Rule("max_length", optional(positive_int), "None or a positive integer (tokens per row)", "set max_length to a positive integer such as 1024 (the default), or None for no truncation"),
    Rule("dataset_num_proc", optional(positive_int), "None or a positive integer", "set dataset_num_proc to a number of worker processes, or leave it None"),
    Rule("pad_to_multiple_of", optional(lambda v: v == "auto" or positive_int(v)), "None, 'auto' or a positive integer", "set pad_to_multiple_of to a positive integer such as 64, to 'auto' (the default) or to None"),
    Rule("per_device_train_batch_size", positive_int, "a positive integer", "set per_device_train_batch_size to 1 or more"),
    Rule("gradient_accumulation_steps", positive_int, "a positive integer", "set gradient_accumulation_steps to 1 or more"),
    Rule("router_aux_loss_coef", optional(lambda v: is_int(v) or isinstance(v, float)), "None or a number", "set router_aux_loss_coef to a number such as 0.001, or leave it None"),
)
# fmt: on


@dataclass
class OfflineConfig(BaseConfig):
    """The fields shared by the trainers that learn from a fixed dataset of token rows.

    SFT, DPO, KTO and reward modelling (in the reference each config declares these again):

    Args:
        router_aux_loss_coef: weight of a Mixture-of-Experts model's load-balancing loss;
            ``None`` uses the model config's value. Only valid for MoE models.
        dataset_num_proc: worker processes for tokenising.
        max_length: the most tokens of a row; ``None``: no truncation.
        pad_to_multiple_of: pad each batch to a multiple of this many tokens; ``"auto"``
            means 128 on AWS Neuron and no padding elsewhere.
        activation_offloading: move the activations saved for backward from the accelerator
            to CPU memory (needs an accelerator).
        pad_token: deprecated: the tokenizer's pad token.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _OFFLINE_RULES

    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE load-balancing auxiliary loss; None uses the model config's value."
        },
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Worker processes for tokenising."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Most tokens of a row; None: no truncation."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad batches to a multiple of this; 'auto': 128 on Neuron, else none."},
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload saved activations from the accelerator to CPU memory."}
    )
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated: set the tokenizer's pad token instead."}
    )

    def _normalise_family(self) -> None:
        """A digit string ``pad_to_multiple_of`` from the command line, or ``"none"``."""
        value = self.pad_to_multiple_of
        if isinstance(value, str) and value != "auto":
            self.pad_to_multiple_of = (
                None if value.lower() in ("none", "null") else int(value) if value.isdigit() else value
            )

    def _check_combinations(self) -> None:
        if self.activation_offloading and self.use_cpu:
            raise ValueError(
                "activation_offloading=True moves activations from an accelerator to CPU memory, but use_cpu=True "
                "trains on the CPU, so there is nothing to offload; set activation_offloading=False."
            )

    def _derive(self) -> None:
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
