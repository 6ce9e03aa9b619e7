"""GOLDConfig: GOLD's and X-Token's fields, defaults and checks (the trainer is ``distill/gold.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_num, optional, positive_int
from posttrain.distill.config import DistillationConfig
from posttrain.sampling.config import ONLINE_UNBUILT

__all__ = ["H_KL_THRESHOLD", "XTOKEN_LOSS_TYPES", "GOLDConfig"]

#: X-Token's losses: ``xtoken_loss_type`` -> what it compares.
XTOKEN_LOSS_TYPES = {
    "p_kl": "forward KL of the teacher and the student projected through W, on the micro-batch's top-k teacher tokens",
    "h_kl": "KL on the tokens whose top-1 projection weight is >= 0.6, sorted-L1 (ULD) on the rest",
}
#: H-KL's bar for a student token's top-1 teacher token to count as common (the paper's).
H_KL_THRESHOLD = 0.6

# ---- the config ------------------------------------------------------------------------------------

# fmt: off
_GOLD_RULES: tuple[Rule, ...] = (
    Rule("lmbda", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (the share of steps trained on the student's own samples)", "set lmbda=0.5 (the default), 1.0 for fully on-policy or 0.0 for the dataset's completions only"),
    Rule("max_length", optional(positive_int), "None or a positive integer (the most prompt + completion tokens)", "set max_length=1024 (the default), or None to keep whole rows"),
    Rule("teacher_tokenizer_name_or_path", optional(lambda v: isinstance(v, str) and bool(v)), "None or a tokenizer id or path", "pass the teacher's tokenizer hub id or folder, or leave None to load it from the teacher"),
    Rule("uld_crossentropy_weight", lambda v: is_num(v) and v >= 0, "a number >= 0 (the weight of the student's NLL)", "set uld_crossentropy_weight=0.0 (the default)"),
    Rule("uld_distillation_weight", lambda v: is_num(v) and v >= 0, "a number >= 0 (the weight of the ULD term)", "set uld_distillation_weight=1.0 (the default)"),
    Rule("uld_student_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set uld_student_temperature=1.0 (the default)"),
    Rule("uld_teacher_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set uld_teacher_temperature=1.0 (the default)"),
    Rule("uld_hybrid_matched_weight", optional(lambda v: is_num(v) and v >= 0), "None (1.0) or a number >= 0", "leave uld_hybrid_matched_weight=None, or set a weight >= 0"),
    Rule("uld_hybrid_unmatched_weight", optional(lambda v: is_num(v) and v >= 0), "None (1.0) or a number >= 0", "leave uld_hybrid_unmatched_weight=None, or set a weight >= 0"),
    Rule("xtoken_loss_type", lambda v: v is None or v in XTOKEN_LOSS_TYPES, "None, 'p_kl' or 'h_kl'", "leave xtoken_loss_type=None, or pick 'p_kl' or 'h_kl'"),
    Rule("xtoken_projection_matrix_path", optional(lambda v: isinstance(v, str) and bool(v)), "None or the path of a saved projection matrix", "build one with `posttrain xtoken-projection` and pass its path"),
    Rule("xtoken_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set xtoken_temperature=1.0 (the default)"),
    Rule("xtoken_vocab_topk", positive_int, "a positive integer (P-KL's teacher tokens per micro-batch)", "set xtoken_vocab_topk=8192 (the default)"),
    Rule("xtoken_kl_weight", lambda v: is_num(v) and v >= 0, "a number >= 0", "set xtoken_kl_weight=1.0 (the default)"),
    Rule("xtoken_ce_scale", lambda v: is_num(v) and v >= 0, "a number >= 0", "set xtoken_ce_scale=0.1 (the default)"),
    Rule("vllm_sync_frequency", positive_int, "a positive integer", "set vllm_sync_frequency=1 (the default)"),
    Rule("log_completions_steps", positive_int, "a positive integer", "set log_completions_steps=100 (the default)"),
    Rule("callbacks", lambda v: isinstance(v, (list, tuple)), "a list", "leave callbacks=[] and pass callbacks to the trainer"),
) + choice_rules({"uld_token_merge_strategy": ("observed", "bayesian")}) + DistillationConfig._rules

_GOLD_UNBUILT: dict[str, UnbuiltOption] = dict(ONLINE_UNBUILT)
# fmt: on


@dataclass
class GOLDConfig(DistillationConfig):
    r"""Configuration of ``GOLDTrainer``: on-policy distillation across model families (GOLD, X-Token).

    The reference's public API (``trl.experimental.gold.GOLDConfig``) with X-Token's fields. Every
    ``transformers.TrainingArguments`` field is accepted too.

    GOLD's fields:
        temperature (`float`, defaults to `0.9`): Sampling temperature; the same-tokenizer JSD is
            taken of `logits / temperature` too (ULD and X-Token have their own temperatures).
        top_p (`float`, defaults to `0.95`), top_k (`int`, defaults to `0`): Sampling filters.
        lmbda (`float`, defaults to `0.5`): Probability that a step trains on the student's own
            samples; otherwise on the teacher's (`seq_kd=True`) or the dataset's completions.
        beta (`float`, defaults to `0.5`): The same-tokenizer generalised JSD's interpolation
            (0 forward KL, 1 reverse KL).
        max_completion_length (`int`, defaults to `128`): Most completion tokens; below
            `max_length`.
        max_length (`int | None`, defaults to `1024`): Most prompt + completion tokens of a
            dataset row (the teacher's prompt is cut to it too).
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: as
            ``DistillationConfig``.
        teacher_tokenizer_name_or_path (`str | None`, defaults to `None`): The teacher's tokenizer
            (cross-tokenizer losses); `None` loads it from the teacher's path.
        disable_dropout (`bool`, defaults to `True`), seq_kd (`bool`, defaults to `False`),
            num_generations (`int`, defaults to `1`), generation_batch_size (`int | None`).
        use_uld_loss (`bool`, defaults to `False`): Universal Logit Distillation across tokenizers.
        uld_token_merge_strategy (`str`, defaults to `"observed"`): Which rows a span's merged
            distribution starts from: `"observed"` the rows at its tokens, `"bayesian"` the row
            before (the one predicting its first token).
        use_extended_uld (`bool`, defaults to `True`): Align the completions by text spans and
            merge the distributions within a span; `False` pairs the i-th tokens of the two
            completions (the original ULD paper's positional truncation).
        uld_use_hybrid_loss (`bool`, defaults to `False`): KL on the tokens whose text both
            vocabularies hold (matched), ULD on the rest; needs `use_uld_loss`.
        uld_hybrid_matched_weight, uld_hybrid_unmatched_weight (`float | None`, default `None`:
            1.0): The hybrid's two weights.
        uld_crossentropy_weight (`float`, defaults to `0.0`), uld_distillation_weight (`float`,
            defaults to `1.0`): `loss = w_d ULD + w_ce NLL`.
        uld_student_temperature, uld_teacher_temperature (`float`, defaults to `1.0`): Each side's
            logits are divided by its temperature before the ULD comparison.
        uld_skip_student_eos, uld_skip_teacher_eos (`bool`, defaults to `True`): Leave each side's
            EOS out of the alignment (also used by X-Token).
        vllm_server_port (`int`, defaults to `8001`), vllm_gpu_memory_utilization (`float`,
            defaults to `0.9`; on vLLM's CPU build a share of main memory: 0.3 there),
            vllm_sync_frequency (`int`, defaults to `1`): vLLM for the student's samples (as
            ``GRPOConfig``; docs/vllm.md); the engine gets the student's weights every
            `vllm_sync_frequency` optimizer steps.
        log_completions (`bool`, defaults to `False`), num_completions_to_print (`int | None`).
        log_completions_steps (`int`, defaults to `100`): With `log_completions`, the training
            completions of every this many optimizer steps are logged (step 0 included).
        wandb_log_unique_prompts (`bool`, defaults to `True`): The reference's name for
            `log_unique_prompts` (each distinct prompt once in the completions table); either
            turns it on.
        callbacks (`list`, defaults to `[]`): The reference's config field; must stay empty: pass
            callbacks to the trainer (`GOLDTrainer(callbacks=...)`).
        learning_rate (`float`, defaults to `1e-7`): The reference's default, kept as the contract
            though it is far below the usual distillation rates (the seed's examples set their own).

    X-Token's fields:
        xtoken_loss_type (`str | None`, defaults to `None`): `"p_kl"` or `"h_kl"`
            (``XTOKEN_LOSS_TYPES``); needs `xtoken_projection_matrix_path`. The paper's recipe is
            off-policy (`lmbda=0.0`).
        xtoken_projection_matrix_path (`str | None`): A projection matrix `[Vs, Vt]` saved by
            `posttrain xtoken-projection` (``save_projection_matrix``).
        xtoken_temperature (`float`, defaults to `1.0`): Both sides' temperature in the KD term,
            which is multiplied by its square.
        xtoken_dynamic_scaling (`bool`, defaults to `True`): Eq. 7, `sg(L_CE / L_KD) L_KD + L_CE`,
            per micro-batch; `False`: `xtoken_kl_weight L_KD + xtoken_ce_scale L_CE`.
        xtoken_vocab_topk (`int`, defaults to `8192`): P-KL's teacher tokens (the micro-batch's
            top-k by teacher mass).
        xtoken_kl_weight (`float`, defaults to `1.0`), xtoken_ce_scale (`float`, defaults to
            `0.1`): The weights without dynamic scaling.

    Other shared online fields are as ``DistillationConfig``; GKD's `max_new_tokens` is not a
    GOLD field (`max_completion_length` is).
    """

    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (and the JSD's)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Keep only the top_k tokens when sampling; 0: all."})
    lmbda: float = field(
        default=0.5, metadata={"help": "Probability that a step trains on the student's own samples."}
    )
    beta: float = field(
        default=0.5, metadata={"help": "Generalised JSD interpolation: 0 forward KL, 1 reverse KL."}
    )
    max_completion_length: int | None = field(default=128, metadata={"help": "Most completion tokens."})
    max_length: int | None = field(default=1024, metadata={"help": "Most prompt + completion tokens."})
    teacher_tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher's tokenizer; None: the teacher's path."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student."})
    seq_kd: bool = field(
        default=False, metadata={"help": "Off the student's steps, train on the teacher's samples."}
    )
    use_uld_loss: bool = field(default=False, metadata={"help": "Universal Logit Distillation."})
    uld_token_merge_strategy: str = field(default="observed", metadata={"help": "'observed' or 'bayesian'."})
    use_extended_uld: bool = field(
        default=True, metadata={"help": "Align by text spans (False: position by position)."}
    )
    uld_use_hybrid_loss: bool = field(
        default=False, metadata={"help": "KL on matched tokens, ULD on the rest."}
    )
    uld_hybrid_matched_weight: float | None = field(
        default=None, metadata={"help": "The matched part's weight."}
    )
    uld_hybrid_unmatched_weight: float | None = field(
        default=None, metadata={"help": "The unmatched part's weight."}
    )
    uld_crossentropy_weight: float = field(default=0.0, metadata={"help": "Weight of the student's NLL."})
    uld_distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the ULD term."})
    uld_student_temperature: float = field(default=1.0, metadata={"help": "The student's ULD temperature."})
    uld_teacher_temperature: float = field(default=1.0, metadata={"help": "The teacher's ULD temperature."})
    uld_skip_student_eos: bool = field(default=True, metadata={"help": "Leave the student's EOS unaligned."})
    uld_skip_teacher_eos: bool = field(default=True, metadata={"help": "Leave the teacher's EOS unaligned."})
    vllm_server_port: int = field(default=8001, metadata={"help": "Port of the vLLM server."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM's GPU memory share."})
    vllm_sync_frequency: int = field(default=1, metadata={"help": "Steps between vLLM weight syncs."})
    log_completions_steps: int = field(
        default=100, metadata={"help": "Optimizer steps between logged training completions."}
    )
    wandb_log_unique_prompts: bool = field(
        default=True, metadata={"help": "Log each distinct prompt once (log_unique_prompts)."}
    )
    callbacks: list[str] = field(
        default_factory=list, metadata={"help": "Must stay empty: pass them to the trainer."}
    )
    learning_rate: float = field(default=1e-7, metadata={"help": "Initial learning rate (the reference's)."})
    xtoken_loss_type: str | None = field(default=None, metadata={"help": "X-Token: 'p_kl' or 'h_kl'."})
    xtoken_projection_matrix_path: str | None = field(
        default=None, metadata={"help": "The saved projection matrix [Vs, Vt]."}
    )
    xtoken_temperature: float = field(default=1.0, metadata={"help": "X-Token's KD temperature."})
    xtoken_dynamic_scaling: bool = field(
        default=True, metadata={"help": "Eq. 7: sg(L_CE / L_KD) L_KD + L_CE."}
    )
    xtoken_vocab_topk: int = field(default=8192, metadata={"help": "P-KL's teacher tokens per micro-batch."})
    xtoken_kl_weight: float = field(default=1.0, metadata={"help": "KD weight without dynamic scaling."})
    xtoken_ce_scale: float = field(default=0.1, metadata={"help": "CE weight without dynamic scaling."})

    _rules: ClassVar[tuple[Rule, ...]] = _GOLD_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = _GOLD_UNBUILT
    _method: ClassVar[str] = "GOLD"
    loss_uses_temperature: ClassVar[bool] = True

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the loss compares the models across tokenizers (ULD or X-Token)."""
        return bool(self.use_uld_loss) or self.xtoken_loss_type is not None

    def _normalise_family(self) -> None:
        """``wandb_log_unique_prompts`` is the reference's name for ``log_unique_prompts``."""
        super()._normalise_family()
        self.log_unique_prompts = bool(self.log_unique_prompts or self.wandb_log_unique_prompts)

    def _check_combinations(self) -> None:
        """The combinations GOLD and X-Token cannot run, then the shared checks.

        Raises:
            ValueError: a combination that cannot work (the message says which and how to fix it).
            NotImplementedError: the teacher sampling in its own tokens (``seq_kd``) across tokenizers.
        """
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} must be below max_length={self.max_length} "
                "(the prompt needs room); raise max_length or lower max_completion_length."
            )
        if self.callbacks:
            raise ValueError(
                f"GOLDConfig(callbacks={self.callbacks!r}): the config's callbacks field is the reference's and must "
                "stay empty; pass callbacks to the trainer instead: GOLDTrainer(..., callbacks=[...])."
            )
        if self.use_uld_loss and self.xtoken_loss_type is not None:
            raise ValueError(
                f"use_uld_loss=True and xtoken_loss_type={self.xtoken_loss_type!r} are two cross-tokenizer losses; "
                "pick one (set use_uld_loss=False for X-Token, or xtoken_loss_type=None for ULD)."
            )
        if (self.xtoken_loss_type is None) != (self.xtoken_projection_matrix_path is None):
            raise ValueError(
                f"xtoken_loss_type={self.xtoken_loss_type!r} and xtoken_projection_matrix_path="
                f"{self.xtoken_projection_matrix_path!r}: X-Token needs both (a loss type and the projection matrix "
                "built by `posttrain xtoken-projection`), and neither is used without the other."
            )
        if self.uld_use_hybrid_loss and not self.use_uld_loss:
            raise ValueError(
                "uld_use_hybrid_loss=True is a variant of the ULD loss; set use_uld_loss=True as well (or leave "
                "uld_use_hybrid_loss=False)."
            )
        if self.seq_kd and self.cross_tokenizer:
            raise NotImplementedError(
                "seq_kd=True with a cross-tokenizer loss (use_uld_loss / xtoken_loss_type) is not built in posttrain: "
                "the teacher would sample in its own tokens. Use seq_kd=False (the dataset's completions off the "
                "student's steps)."
            )
        super()._check_combinations()
