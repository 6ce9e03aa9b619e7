"""Configuration of the CPO trainer (CPO, SimPO, AlphaPO): ``CPOConfig``, a drop-in for
``trl.experimental.cpo.CPOConfig``.

Only CPO's own fields are declared here; the fields ORPO and CPO share come from
``orpo.config.ReferenceFreeConfig``, and the valid loss types from the loss table of
``cpo/losses.py``.
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import Rule, choice_rules, is_num, optional
from posttrain.cpo import losses
from posttrain.orpo.config import ReferenceFreeConfig

__all__ = ["CPOConfig"]

CHOICES: dict[str, tuple[str, ...]] = {"loss_type": tuple(losses.LOSS_TYPES)}

# fmt: off
_RULES: tuple[Rule, ...] = ReferenceFreeConfig._rules + choice_rules(CHOICES) + (
    Rule("beta", lambda v: is_num(v) and 0 < v < float("inf"), "a finite number > 0", "set beta to a positive number such as 0.1 (CPO) or 2.5 (SimPO, AlphaPO)"),
    Rule("label_smoothing", lambda v: is_num(v) and 0 <= v < 0.5, "a number in [0, 0.5)", "set label_smoothing to the assumed rate of flipped labels, such as 0.1, or 0.0 (the default)"),
    Rule("cpo_alpha", optional(lambda v: is_num(v) and 0 <= v < float("inf")), "None or a finite number >= 0", "set cpo_alpha (the weight of the chosen completions' NLL) such as 1.0, or leave it None for the loss type's default"),
    Rule("simpo_gamma", lambda v: is_num(v) and abs(v) < float("inf"), "a finite number", "set simpo_gamma (SimPO's target margin) to a number such as 0.5"),
    Rule("alpha", lambda v: is_num(v) and abs(v) < float("inf"), "a finite number", "set alpha (AlphaPO's reward shape) to a number such as 0.25, or 0.0 for the plain log-probability"),
)
# fmt: on


@dataclass
class CPOConfig(ReferenceFreeConfig):
    r"""Configuration of :class:`~posttrain.CPOTrainer`, a drop-in for ``trl.experimental.cpo.CPOConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter, the shared ones of
    ``OfflineConfig`` (`pad_to_multiple_of="auto"`, `dataset_num_proc`, `activation_offloading`,
    `pad_token`, `router_aux_loss_coef`, `model_init_kwargs`, `trust_remote_code`,
    `logging_steps=10`, `gradient_checkpointing=True`, `bf16=None`), those of
    ``ReferenceFreeConfig`` (`learning_rate=1e-6`, `max_length=1024`, `max_completion_length`,
    `disable_dropout=True`, `generate_during_eval`, `is_encoder_decoder`, `warmup_ratio`) and:

    Args:
        loss_type (`str`, defaults to `"sigmoid"`): One of `cpo.losses.LOSS_TYPES`: `"sigmoid"`
            (CPO), `"hinge"`, `"ipo"`, `"simpo"` (SimPO), `"alphapo"` (AlphaPO: SimPO's loss on
            the `alpha`-shaped reward, without the NLL by default).
        beta (`float`, defaults to `0.1`): β, the inverse temperature of the reward margin.
        label_smoothing (`float`, defaults to `0.0`): The assumed rate of flipped labels, in
            [0, 0.5), for `sigmoid`, `simpo` and `alphapo`; an error with `hinge` and `ipo`.
        cpo_alpha (`float | None`, defaults to `None`): The weight of the chosen completions'
            NLL. `None` resolves to the loss type's default: 1.0, or 0.0 for `alphapo`. A value
            given is kept (the reference overwrites it with 0 for `alphapo`).
        simpo_gamma (`float`, defaults to `0.5`): γ, SimPO's target reward margin (`simpo`,
            `alphapo`).
        alpha (`float`, defaults to `0.0`): AlphaPO's reward shape: the reward is
            `(1 - e^{-alpha * logp}) / alpha` for any loss type, `logp` itself at 0. With a
            summed log-probability (`sigmoid`, `hinge`) and `alpha > 0` the reward grows like
            `e^{alpha * |logp|}` with the completion's length (a warning says so); it is capped
            past `e^80`.
    """

    _rules: ClassVar[tuple[Rule, ...]] = _RULES

    loss_type: str = field(default="sigmoid", metadata={"help": f"One of {', '.join(losses.LOSS_TYPES)}."})
    beta: float = field(default=0.1, metadata={"help": "β, the inverse temperature of the reward margin."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "The assumed rate of flipped labels, in [0, 0.5)."}
    )
    cpo_alpha: float | None = field(
        default=None,
        metadata={"help": "Weight of the chosen completions' NLL; None: 1.0, or 0.0 for alphapo."},
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "γ, SimPO's target reward margin."})
    alpha: float = field(default=0.0, metadata={"help": "AlphaPO's reward shape (0: the log-probability)."})

    def _normalise_family(self) -> None:
        """``cpo_alpha=None`` becomes the loss type's default NLL weight (1.0, or 0.0 for alphapo)."""
        super()._normalise_family()
        spec = losses.LOSS_TYPES.get(self.loss_type) if isinstance(self.loss_type, str) else None
        if self.cpo_alpha is None and spec is not None:
            self.cpo_alpha = spec.default_cpo_alpha

    def _check_combinations(self) -> None:
        """The loss settings together; warn where ``alpha`` does not do what it is likely meant to."""
        super()._check_combinations()
        spec = losses.check_loss_settings(
            self.loss_type, self.beta, self.label_smoothing, self.simpo_gamma, self.alpha, self.cpo_alpha
        )
        if self.alpha > 0 and not spec.length_normalised:
            warnings.warn(
                f"alpha={self.alpha} with loss_type={self.loss_type!r} shapes the *summed* completion log-probability: "
                "the reward (1 - e^{-alpha * logp}) / alpha grows like e^{alpha * |logp|} with the completion's "
                "length, and stops changing (no gradient) past e^80. AlphaPO shapes the mean token "
                "log-probability: use loss_type='alphapo' (or 'simpo').",
                UserWarning,
                stacklevel=4,
            )
        if self.loss_type == "alphapo" and self.alpha == 0:
            warnings.warn(
                "loss_type='alphapo' with alpha=0.0 is SimPO (the reward shape is the identity); set alpha, "
                "e.g. 0.25 as the AlphaPO paper, or use loss_type='simpo'.",
                UserWarning,
                stacklevel=4,
            )
