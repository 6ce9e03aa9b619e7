"""The base trainer every posttrain trainer extends: ``BaseTrainer`` (a ``transformers.Trainer``).

What every trainer needs and no family should write again:

- the policy and its tokenizer from a hub id, a path, an embedded name, a ``PreTrainedModel``
  or a ``PeftModel`` (``model_init_kwargs``, quantized loading, the pad token), PEFT wrapping,
  and a frozen reference copy where a family needs one (ZeRO-3 and FSDP2 included);
- guards: a non-finite loss or gradient stops training before the update is applied, naming
  the step and the last logged metrics;
- crash-safe checkpoints: posttrain's state file is written last as the completion mark, old
  checkpoints are rotated only after the new one is complete, and each family adds its own
  state through ``_save_extra_state`` / ``_load_extra_state``, so every trainer resumes exactly;
- the metrics store (``self._metrics``) whose means are merged into each ``log`` call, the
  ``step_time`` metric, and the end-of-run plots;
- on the CPU, glibc's heap kept small and selective gradient checkpointing (``ops/``);
- selective activation checkpointing (``gradient_checkpointing_kwargs={"selective": True}``,
  ``ops/sac.py``), on every device.

A family's ``__init__`` checks its data and arguments first (cheap), then calls
``super().__init__``, which loads the model (expensive).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput, rotate_checkpoints

from posttrain.core import checkpoints
from posttrain.core.config import family_option
from posttrain.models import distributed, loading
from posttrain.models import peft as peft_utils
from posttrain.models import reference as model_options
from posttrain.models.compat import checkpointing_enabled, checkpointing_kwargs
from posttrain.models.reference import mix_into_reference, should_sync_reference
from posttrain.observe.metrics import MetricStore
from posttrain.ops import checkpointing, float32_attention, memory, sac, weight_casts, workspace
from posttrain.ops.dropout import faster_lora_dropout

REFERENCE_STATE = "reference_model.pt"
PACKABLE_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations that keep packed sequences apart (a 4-D mask, or varlen kernels)."""
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that read packed sequences from ``position_ids`` (no mask)."""


class BaseTrainer(Trainer):
    """A ``transformers.Trainer`` with posttrain's model loading, guards, checkpoints and metrics.

    Args:
        model: hub id, local path, embedded name (``"smollm2-135m-instruct"``), a
            ``PreTrainedModel`` or a ``peft.PeftModel``. Strings are loaded with
            ``args.model_init_kwargs``, in float32 unless a ``dtype`` is given there.
        args: the family's config (a ``BaseConfig``).
        processing_class: the tokenizer; loaded from the model when ``None``. Left padding is set
            and the pad token falls back to EOS.
        peft_config: a ``peft.PeftConfig``: the policy is wrapped and only the adapter trains.
        quantization_config: a transformers quantization config to load ``model`` by name
            (QLoRA, with ``peft_config``).
        **trainer_kwargs: the rest of ``transformers.Trainer``'s arguments.
    """

    #: What the family trains, routed to ``models.loading``: ``"causal_lm"`` (a language model
    #: that generates) or ``"sequence_classification"`` (one score per row: reward models).
    _model_kind: ClassVar[str] = "causal_lm"

    def __init__(
        self,
        model: Any,
        args: Any,
        processing_class: Any = None,
        peft_config: Any = None,
        quantization_config: Any = None,
        **trainer_kwargs: Any,
    ) -> None:
        model, source = self._setup_model(model, args, peft_config, quantization_config)
        processing_class = self._setup_tokenizer(
            processing_class, source, args, loading.is_vision_model(model)
        )
        super().__init__(model=model, args=args, processing_class=processing_class, **trainer_kwargs)
        #: The MoE router loss's weight in force (``router_aux_loss_coef``; 0 for a dense model),
        #: added by ``_plus_aux_loss``. Reward models (one score per row) have none.
        self.aux_loss_coef = (
            model_options.set_router_aux_loss_coef(self.model, family_option(args, "router_aux_loss_coef"))
            if self._model_kind == "causal_lm"
            else 0.0
        )
        self._trim_hooks: list[Any] = []
        if self.accelerator.device.type == "cpu":  # glibc's heap (ops/memory.py):
            # pinned pages only speed copies to an accelerator: off, as transformers does for use_cpu
            # (torch warns at every data loader with pin_memory and no accelerator)
            self.args.dataloader_pin_memory = False
            memory.map_large_blocks()  # large activations stay out of it,
            self._trim_hooks = memory.trim_heap_in_backward(self.model)  # freed small ones leave it
            checkpointing.enabled()  # a bad POSTTRAIN_SELECTIVE_CHECKPOINTING fails here, not mid-step
        #: one bf16 cast per weight per micro-step under CPU autocast (ops/weight_casts.py)
        self._weight_casts = weight_casts.WeightCasts() if weight_casts.applies(args) else None
        #: short attention in float32 under CPU bf16 autocast (ops/float32_attention.py)
        self._float32_attention = float32_attention.applies(args)
        self.add_callback(_Guards(self))
        self._metrics = MetricStore()
        self._last_logs: dict[str, float] = {}
        self._step_time = 0.0
        self._micro_in_step = 0
        self._step_grad_norm: Any = None  # the pre-clip gradient norm of the optimizer step under way

    @staticmethod
    def default_args(model: Any, config_class: type, suffix: str) -> Any:
        """The config a trainer builds when given none: defaults, output in ``<model name>-<suffix>``."""
        base = model if isinstance(model, str) else model.config._name_or_path
        return config_class(output_dir=f"{os.path.basename(str(base).rstrip('/')) or 'model'}-{suffix}")

    # ---- model and tokenizer ---------------------------------------------------------------------

    @classmethod
    def _setup_model(
        cls, model: Any, args: Any, peft_config: Any = None, quantization_config: Any = None
    ) -> tuple[Any, str]:
        """The policy to train (of the family's ``_model_kind``) and the name or path its tokenizer loads from."""
        _check_liger(args)
        peft_utils.check_peft_arguments(model, peft_config, args, quantization_config)
        if isinstance(model, str):
            source = loading.resolve_model_path(model)
            policy = loading.load_policy(
                source,
                args.model_init_kwargs,
                args.trust_remote_code,
                quantization_config,
                args.device,
                kind=cls._model_kind,
            )
        elif isinstance(model, PreTrainedModel):
            policy, source = model, model.config._name_or_path  # model_init_kwargs then unused
        elif peft_utils.is_peft_model(model):
            policy, source = model, model.get_base_model().config._name_or_path
        else:
            raise TypeError(
                f"model must be a hub id, a local path, an embedded name, a PreTrainedModel or a PeftModel; "
                f"got {type(model).__name__}."
            )
        loading.check_model_kind(policy, cls._model_kind)
        if peft_config is not None or peft_utils.is_peft_model(policy):
            policy = peft_utils.wrap_policy(policy, peft_config, checkpointing_enabled(args))
            faster_lora_dropout(policy)  # the same masks' distribution, 3x faster to draw on the CPU
        if family_option(args, "disable_dropout"):
            loading.disable_dropout(policy)
        if family_option(args, "cast_lm_head_to_fp32"):
            model_options.cast_lm_head_to_fp32(policy)
        coef = family_option(args, "router_aux_loss_coef")
        if coef is not None and not model_options.is_moe(policy):
            model_options.set_router_aux_loss_coef(policy, coef)  # raises, before training
        return policy, source

    @staticmethod
    def _setup_tokenizer(processing_class: Any, source: str, args: Any, vision: bool = False) -> Any:
        """The given processing class, or the model's tokenizer (its processor for a vision model ``vision``)."""
        if processing_class is None:
            revision = (args.model_init_kwargs or {}).get("revision")
            processing_class = loading.load_tokenizer(
                source, revision, args.trust_remote_code, processor=vision
            )
        return loading.prepare_tokenizer(processing_class)

    @property
    def _tokenizer(self) -> Any:
        """The text tokenizer (a processor's ``tokenizer``, or the processing class itself)."""
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    @property
    def _varlen_attention(self) -> bool:
        """Whether the model's attention reads packed sequences from their positions (flash-attention)."""
        return getattr(self.model.config, "_attn_implementation", None) in VARLEN_ATTENTION

    def _check_packable_attention(self, options: str) -> None:
        """Refuse, at construction, an attention that would let packed sequences attend to each other.

        Args:
            options: the options that pack sequences, as the message names them.
        """
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in PACKABLE_ATTENTION:
            raise ValueError(
                f"{options} put several sequences in one row, but the model's attention "
                f"implementation {impl!r} would let them attend to each other. Load the model with "
                f"attn_implementation in {list(PACKABLE_ATTENTION)} (model_init_kwargs), or set "
                f"{' and '.join(f'{o}=False' for o in options.split('/'))}."
            )

    def _apply_pad_token(self, pad_token: str | None) -> None:
        """The deprecated ``pad_token`` option of the offline configs: the tokenizer's pad token, before tokenising."""
        if pad_token is None:
            return
        warnings.warn(
            f"{type(self.args).__name__}.pad_token is deprecated; set tokenizer.pad_token and pass the tokenizer "
            "as processing_class.",
            FutureWarning,
            stacklevel=3,
        )
        tok = self._tokenizer
        if tok.convert_tokens_to_ids(pad_token) in (None, tok.unk_token_id):
            raise ValueError(
                f"pad_token={pad_token!r} is not a token of the tokenizer's vocabulary; pass one of its tokens "
                f"(e.g. its EOS token {tok.eos_token!r}) or leave pad_token None."
            )
        tok.pad_token = pad_token

    def _offloading(self) -> contextlib.AbstractContextManager:
        """With ``activation_offloading``, the tensors saved for backward live in CPU memory."""
        if family_option(self.args, "activation_offloading"):
            return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        return contextlib.nullcontext()

    def _create_reference(self) -> torch.nn.Module:
        """A frozen copy of the initial policy for a KL or a preference reference.

        Under ZeRO-3 and FSDP2 the copy is sharded like the policy (``models.distributed``).
        """
        a = self.args
        return distributed.create_reference(
            self.model,
            self.accelerator,
            reload=lambda: loading.load_policy(
                self.model.config._name_or_path, a.model_init_kwargs, a.trust_remote_code
            ),
        )

    def _offline_reference(self, ref_model: Any) -> torch.nn.Module | None:
        """The frozen reference of an offline trainer (DPO, KTO): given, loaded by name, or a copy.

        ``ref_model`` given as a model is used frozen (dropout off with ``disable_dropout``); a
        name is loaded like the policy. Without one: ``None`` for a PEFT policy (its reference is
        its own base, adapters off: ``_as_reference``), else a frozen copy of the policy *as
        given*, in-memory changes included (the reference library reloads the model by name).
        """
        a = self.args
        self._check_reference_sync()
        if isinstance(ref_model, str):
            ref_model = loading.load_policy(
                loading.resolve_model_path(ref_model), a.model_init_kwargs, a.trust_remote_code
            )
        if ref_model is not None:
            ref_model = model_options.create_reference(ref_model.to(self.accelerator.device))
            if family_option(a, "disable_dropout"):
                loading.disable_dropout(ref_model)
            return ref_model
        if peft_utils.is_peft_model(self.model):
            return None
        return self._create_reference()

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[torch.nn.Module]:
        """The model to score the reference with: ``self.ref_model``, else the adapters-off policy.

        A separate ``ref_model`` runs under the policy's autocast (``bf16=True``), as accelerate's
        wrapper runs the policy's forward: the two score in one precision, so their KL is 0 where
        they are equal, not bf16's rounding.
        """
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            with self.accelerator.autocast():
                yield reference
            return
        with peft_utils.adapters_disabled(self.model) as base:
            yield base

    def _check_reference_sync(self) -> None:
        """TR-DPO (``sync_ref_model``) mixes the policy into the reference parameter by parameter.

        Raises:
            NotImplementedError: with FSDP2 or DeepSpeed, whose sharded parameters do not allow it.
        """
        if family_option(self.args, "sync_ref_model") and (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            raise NotImplementedError(
                "sync_ref_model=True is not supported with FSDP2 or DeepSpeed in posttrain: the reference is "
                "mixed with the policy parameter by parameter, which sharded parameters do not allow. Train "
                "without sync_ref_model, or with DDP."
            )

    def _sync_reference(self, reference: torch.nn.Module | None) -> None:
        """TR-DPO: ``reference <- alpha * policy + (1 - alpha) * reference`` every ``ref_model_sync_steps``.

        Called once per optimizer step by the families that have ``sync_ref_model``; saved with
        each checkpoint by ``_save_reference``.
        """
        a = self.args
        if reference is None or not family_option(a, "sync_ref_model"):
            return
        if should_sync_reference(self.state.global_step, family_option(a, "ref_model_sync_steps")):
            mix_into_reference(
                reference.parameters(), self.model.parameters(), family_option(a, "ref_model_mixup_alpha")
            )

    def create_accelerator_and_postprocess(self) -> None:
        """transformers' Accelerator; on CPU processes switched to the FSDP2 that ``fsdp`` asks for."""
        super().create_accelerator_and_postprocess()
        distributed.use_fsdp_on_cpu(self)

    # ---- guards and timing -----------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-step; stops on a non-finite loss and times whole optimizer steps (``step_time``)."""
        start = time.perf_counter()
        if self._weight_casts is not None:  # one bf16 cast per weight for the whole micro-step
            self._weight_casts.attach(self.model)
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._weight_casts is not None:
                self._weight_casts.release()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"The loss became {loss.item()} at optimizer step {self.state.global_step + 1}, before any update "
                f"was applied (the parameters and the checkpoints are intact). Last logged metrics: "
                f"{self._last_logs}. Lower the learning rate, check the rewards, or use bf16/fp32."
            )
        self._step_time += time.perf_counter() - start
        self._micro_in_step += 1
        if self._micro_in_step >= self.current_gradient_accumulation_steps:
            self._metrics.add("train", "step_time", self._step_time)
            self._step_time, self._micro_in_step = 0.0, 0
        return loss

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """transformers' pre-clip norm of all gradients, kept for ``_check_gradients``."""
        self._step_grad_norm = super()._get_grad_norm(model, grad_norm)
        return self._step_grad_norm

    def _check_gradients(self) -> None:
        """Stop before the optimizer applies a NaN or inf gradient.

        A finite total norm (transformers' clipping computes it just before) means every entry is
        finite, and so are the clipped ones: nothing more to compute. Otherwise, or where no norm was
        computed, each gradient's own norm finds the suspects.
        """
        total, self._step_grad_norm = self._step_grad_norm, None
        if hasattr(total, "full_tensor"):  # FSDP2's norm is a DTensor
            total = total.full_tensor()
        if total is not None and math.isfinite(float(total)):
            return
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        if not named:
            return
        # One norm per gradient: no gradient-sized temporaries (isfinite on a 28M-entry embedding
        # gradient allocates ~150 MB). A norm is non-finite if an entry is, or if it overflows; the
        # suspects are then checked entry by entry.
        norms = torch._foreach_norm([g for _, g in named])
        norms = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms])  # FSDP2
        suspects = torch.nonzero(~torch.isfinite(norms)).flatten().tolist()
        bad = [named[i][0] for i in suspects if not torch.isfinite(named[i][1]).all()]
        if bad:
            raise FloatingPointError(
                f"Non-finite gradients in {bad[:3]}{' ...' if len(bad) > 3 else ''} at optimizer step "
                f"{self.state.global_step + 1}; the update was not applied (the parameters and the checkpoints "
                f"are intact). Last logged metrics: {self._last_logs}. Lower the learning rate or check the inputs."
            )

    def _after_optimizer_step(self) -> None:
        """A family's once-per-optimizer-step updates (after the step's last micro-batch)."""

    # ---- what every family's loss shares -----------------------------------------------------------

    def _refuse_outputs(self, return_outputs: bool) -> None:
        """``compute_loss(return_outputs=True)`` is refused: posttrain's losses build no logits.

        Raises:
            ValueError: ``return_outputs`` is true.
        """
        if return_outputs:
            raise ValueError(
                f"{type(self).__name__}.compute_loss does not return model outputs (no logits are built; it "
                "returns the loss). Call the model itself for its outputs."
            )

    def _plus_aux_loss(
        self, loss: torch.Tensor, aux_loss: torch.Tensor | None, accumulation: float | None = None
    ) -> torch.Tensor:
        """``loss`` plus the MoE router loss weighted by ``router_aux_loss_coef``, as its share of the
        accumulated step (``accumulation`` micro-batches; the trainer's count when ``None``); a dense
        model's loss unchanged."""
        if not self.aux_loss_coef or aux_loss is None:
            return loss
        steps = accumulation if accumulation is not None else self.current_gradient_accumulation_steps
        return loss + self.aux_loss_coef * aux_loss / steps

    def _as_share_of_step(
        self, loss: torch.Tensor, local: float | None = None, total: float | None = None
    ) -> torch.Tensor:
        """Scale a micro-batch's loss so that the step's gradient (DDP averages it over processes,
        accumulation sums the micro-batches) is that of the mean over every item of the step.

        Args:
            loss: the micro-batch's mean over its ``local`` items, or (``local=None``) its sum
                already divided by the step's item count.
            local: the micro-batch's items (pairs, examples), when ``loss`` is their mean.
            total: the step's items over every process and micro-batch.
        """
        share = 1.0 if local is None else local / max(float(total), 1.0)
        return loss * share * self.accelerator.num_processes

    def _map_datasets(self, prepare: Callable[[Any], Any]) -> None:
        """Apply ``prepare`` to the train dataset and to the eval dataset (each one of a dict)."""
        self.train_dataset = prepare(self.train_dataset)
        self._map_eval(prepare)

    def _map_eval(self, prepare: Callable[[Any], Any]) -> None:
        """Apply ``prepare`` to the eval dataset, or to each one of a dict of them."""
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: prepare(v) for k, v in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = prepare(self.eval_dataset)

    def _eval_datasets(self) -> list[Any]:
        """The eval datasets (the values of a dict of them), none when there is no eval dataset."""
        if isinstance(self.eval_dataset, dict):
            return list(self.eval_dataset.values())
        return [] if self.eval_dataset is None else [self.eval_dataset]

    def _token_metrics(
        self, mode: str, stats: Any, mask: torch.Tensor, rows: Any, accuracy_mask: torch.Tensor | None = None
    ) -> dict[str, float]:
        """The per-token metrics every offline trainer logs, over every process's target tokens.

        ``entropy`` and ``mean_token_accuracy`` (when ``stats`` has them), ``num_tokens`` (train:
        the tokens seen so far, padding excluded where rows are padded) and ``aux_loss`` (MoE).

        Args:
            mode: ``"train"`` or ``"eval"``.
            stats: the ``SequenceStats`` of the micro-batch.
            mask: [N, L - 1] 1 on the target tokens.
            rows: the micro-batch's ``Sequences``.
            accuracy_mask: the targets ``mean_token_accuracy`` counts, when not all of ``mask``
                (a preference pair's chosen side, as the reference counts it).
        """
        device = self.accelerator.device
        m: dict[str, float] = {}
        if stats.entropy is not None and stats.top is not None:
            correct = (stats.logps.detach() == stats.top).to(mask.dtype)
            counted = mask if accuracy_mask is None else accuracy_mask.to(mask.dtype)
            local = torch.stack(
                [(stats.entropy * mask).sum(), mask.sum(), (correct * counted).sum(), counted.sum()]
            ).to(device)
            entropy, targets, hits, counted_targets = gather(local.unsqueeze(0)).sum(dim=0).tolist()
            m["entropy"] = entropy / max(targets, 1.0)
            m["mean_token_accuracy"] = hits / max(counted_targets, 1.0)
        if mode == "train":
            padded = rows.attention_mask is not None and rows.attention_mask.dim() == 2
            tokens = int(rows.attention_mask.sum()) if padded else rows.input_ids.numel()
            self.state.num_input_tokens_seen += int(gather(torch.tensor([tokens], device=device)).sum())
            m["num_tokens"] = float(self.state.num_input_tokens_seen)
        if stats.aux_loss is not None:
            m["aux_loss"] = float(stats.aux_loss.detach())
        return m

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """Evaluation: the batch's loss (its metrics are logged ``eval_``-prefixed); no logits."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """The families count tokens themselves (``num_tokens``, padding excluded)."""

    def floating_point_ops(self, inputs: Any) -> int:
        """About 6 FLOPs per parameter per token (forward and backward), as transformers estimates."""
        return 6 * self._batch_tokens(inputs) * self.model.num_parameters(exclude_embeddings=True)

    def _batch_tokens(self, inputs: Any) -> int:
        """Tokens the model runs on for one micro-batch (a ``Sequences`` by default)."""
        return int(inputs.input_ids.numel())

    def gather_values(self, local: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D ``local`` values, concatenated in rank order (lengths may differ)."""
        if self.accelerator.num_processes == 1:
            return local
        device = self.accelerator.device
        counts = gather(torch.tensor([local.numel()], device=device)).tolist()
        padded = torch.zeros(max(counts), dtype=local.dtype, device=device)
        padded[: local.numel()] = local.to(device)
        rows = gather(padded.unsqueeze(0))  # [processes, max count]
        return torch.cat([row[:n] for row, n in zip(rows, counts, strict=True)])

    # ---- logging ---------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the metrics averaged since the last log (``eval_``-prefixed during evaluation)."""
        eval_loss = next((k for k in logs if k.startswith("eval") and k.endswith("_loss")), None)
        mode = "eval" if eval_loss is not None else "train"
        self._before_log(mode)
        if eval_loss is not None:
            prefix = eval_loss[: -len("loss")]
            metrics = {prefix + k: v for k, v in self._metrics.pop_means("eval").items()}
        else:
            metrics = self._metrics.pop_means("train")
        merged = {**logs, **metrics}
        if all(isinstance(v, (int, float)) and v == v for v in merged.values()):
            self._last_logs = {"step": self.state.global_step, **merged}
        super().log(merged, start_time)

    def _before_log(self, mode: str) -> None:
        """A family's work before its metrics are logged (e.g. flushing a completions table)."""

    def _on_train_end(self) -> None:
        """A family's work when training ends, before the plots are written."""

    def _write_plots(self) -> None:
        """The run's curves as PNGs in ``output_dir/plots`` (needs matplotlib: the ``plot`` extra)."""
        from posttrain.observe.plots import write_plots_from_log_history

        try:
            write_plots_from_log_history(self.state.log_history, os.path.join(self.args.output_dir, "plots"))
        except ImportError as exc:
            warnings.warn(f"No plots written at the end of training: {exc}", stacklevel=2)

    # ---- checkpoints -----------------------------------------------------------------------------

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """Save what this process's family state needs beyond ``transformers.Trainer``'s.

        Called on every process after the checkpoint's files are written. Returns the small
        values (JSON) that the main process writes into the completion mark. Here: a reference
        model that moves during training (TR-DPO's ``sync_ref_model``); a family adds its own
        state and calls this.
        """
        reference = getattr(self, "ref_model", None)
        if reference is not None and family_option(self.args, "sync_ref_model"):
            self._save_reference(folder, reference)
        return {}

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        """Restore what ``_save_extra_state`` saved (``state``: the completion mark's values)."""
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            self._load_reference(folder, reference)

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any
    ) -> Any:
        """Train; ``resume_from_checkpoint=True`` resumes from the newest *complete* checkpoint."""
        if self.args.should_save:
            left = checkpoints.remove_leftovers(self._get_output_dir(trial=trial))
            if left:
                warnings.warn(
                    f"Removed {left} from {self.args.output_dir!r}: the staging folders of a save that a "
                    "killed run did not finish (its whole checkpoints are kept).",
                    stacklevel=2,
                )
        if resume_from_checkpoint is True:  # None when only an interrupted first save is there
            resume_from_checkpoint = checkpoints.latest_complete_checkpoint(self.args.output_dir)
        if isinstance(resume_from_checkpoint, str):
            checkpoints.check_resumable(resume_from_checkpoint, needs_optimizer=not self.args.save_only_model)
            done = checkpoints.finished_output(resume_from_checkpoint, self.args.max_steps)
            if done is not None:  # transformers would train one more step
                self.state = done
                self._load_from_checkpoint(resume_from_checkpoint)
                return TrainOutput(done.global_step, 0.0, {})
        attention = (
            float32_attention.float32_short_attention()
            if self._float32_attention
            else contextlib.nullcontext()
        )
        try:
            with attention:
                return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            workspace.release()  # the chunked head's kept scratch buffers (ops/workspace.py)

    def _use_selective_checkpointing(self) -> None:
        """Turn ``selective`` of the checkpointing kwargs into SAC's ``context_fn`` (``ops/sac.py``).

        Runs when training begins: ``Trainer.train`` has enabled checkpointing with the config's
        kwargs by then, and no training forward has run yet.
        """
        if checkpointing_enabled(self.args):
            sac.use_selective_checkpointing(self.model, checkpointing_kwargs(self.args))

    def _get_output_dir(self, trial: Any) -> str:
        """The run's folder; while a checkpoint is being written, its staging folder."""
        staging = getattr(self, "_staging_dir", None)
        return staging if staging is not None else super()._get_output_dir(trial=trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save as transformers does, into a hidden staging folder, then the family's state, then
        posttrain's state (the completion mark); flush it all to disk and rename the folder to
        ``checkpoint-N`` in one step (``core/checkpoints.py``).

        Old checkpoints are rotated only after the new one is published, so a kill at any moment
        leaves whole checkpoints only, the newest among them.
        """
        run_dir = self._get_output_dir(trial=trial)
        name = f"checkpoint-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging = checkpoints.staging_folder(run_dir, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving this step
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
            self._staging_dir = None
        folder = os.path.join(staging, name)
        os.makedirs(folder, exist_ok=True)
        values = self._save_extra_state(folder)
        for callback in self.callback_handler.callbacks:  # callbacks with checkpoint state (BEMA)
            save = getattr(callback, "save_checkpoint_state", None)
            if callable(save):
                save(folder, self.state)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            best = self.state.best_model_checkpoint
            if best is not None and best.startswith(staging + os.sep):  # named while staged
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                self.state.save_to_json(os.path.join(folder, checkpoints.TRAINER_STATE_FILE))
            checkpoints.write_state(folder, values)
            checkpoints.publish(folder, final)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model (and processing class) so that ``from_pretrained`` loads it.

        A call from outside training (the final save) writes into a staging folder first and
        moves each file into ``output_dir`` whole (``checkpoints.publish_files``): a kill while
        saving leaves each file either the previous save's or this one's. Checkpoints are staged
        as whole folders by ``_save_checkpoint``.
        """
        if _internal_call:
            super().save_model(output_dir, _internal_call=True)
            return
        target = output_dir if output_dir is not None else self.args.output_dir
        staging = checkpoints.staging_folder(target, "save")
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        super().save_model(staging, _internal_call=True)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoints.publish_files(staging, target)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    @property
    def _load_location(self) -> Any:
        """Where checkpoint tensors load: "cpu" on CPU processes (torch cannot restore "cpu:0")."""
        return "cpu" if self.accelerator.device.type == "cpu" else self.accelerator.device

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_extra_state(resume_from_checkpoint, checkpoints.read_state(resume_from_checkpoint))

    def _save_reference(self, folder: str, reference: torch.nn.Module) -> None:
        """Save a reference model that moved during training (TR-DPO sync), on the main process."""
        if self.args.should_save:
            torch.save(reference.state_dict(), os.path.join(folder, REFERENCE_STATE))

    def _load_reference(self, folder: str, reference: torch.nn.Module) -> None:
        """Restore a reference saved by ``_save_reference``, if the checkpoint has one."""
        path = os.path.join(folder, REFERENCE_STATE)
        if os.path.isfile(path):
            reference.load_state_dict(torch.load(path, map_location=self._load_location))


def check_offline_datasets(
    trainer: str,
    train_dataset: Any,
    eval_dataset: Any,
    item: str,
    check_first: Callable[[str, Any], None],
    check_images: Callable[[str], None] | None = None,
) -> bool:
    """Check an offline trainer's datasets (train, eval or a dict of evals) before any model loads.

    Args:
        trainer: the trainer's name, for the messages.
        train_dataset, eval_dataset: as given to the trainer (``None`` datasets are skipped).
        item: what one row is (``"example"``, ``"preference pair"``), for the messages.
        check_first: ``check_first(name, dataset)`` checks a map-style, non-empty dataset's
            columns and first row, raising ``ValueError`` with the family's message.
        check_images: for a family that takes images, ``check_images(name)`` checks the options
            against a dataset with an ``image`` / ``images`` column; ``None``: images are refused.

    Returns:
        Whether a dataset has images.

    Raises:
        ValueError: a streamed (``IterableDataset``) or empty dataset, or what ``check_first`` raises.
        NotImplementedError: a dataset with images for a family without ``check_images``: it
            trains on text only, and would otherwise drop the column without a word.
    """
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    has_images = False
    for name, dataset in [("train_dataset", train_dataset), *evals]:
        if dataset is None:
            continue
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"{name} is an IterableDataset; {trainer} tokenises the whole dataset first. Materialise it "
                "(datasets.Dataset.from_list(list(stream)))."
            )
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty; pass a dataset with at least one {item}.")
        images = next(
            (c for c in ("image", "images") if c in (getattr(dataset, "column_names", None) or [])), None
        )
        if images is not None and check_images is not None:
            check_images(name)
            has_images = True
        elif images is not None:
            raise NotImplementedError(
                f"{name} has an {images!r} column, but {trainer} with images (a vision-language model's data) is not "
                "built yet: it trains on the text alone and would drop the images without a word. Remove the column "
                "to train on the text (dataset.remove_columns(...)); SFTTrainer, DPOTrainer, GRPOTrainer and "
                "RLOOTrainer take images."
            )
        check_first(name, dataset)
    return has_images


def refuse_logit_hooks(trainer: str, logged: str, *, needs: str | None = None, **hooks: Any) -> None:
    """Refuse the ``transformers.Trainer`` hooks that need what posttrain's trainer never builds.

    Args:
        trainer: the trainer's name, for the message.
        logged: what the trainer logs instead (for train and eval).
        needs: what the hooks need that the trainer does not build (default: the full logits).
        **hooks: the hooks by name (``compute_metrics=...``); ``None`` when not given.

    Raises:
        NotImplementedError: naming every hook given.
    """
    given = [name for name, value in hooks.items() if value is not None]
    if given:
        lack = needs or (
            "the model's full [batch, length, vocabulary] logits, which posttrain's "
            f"{trainer} never builds (it takes its log-probs from the hidden states in chunks)"
        )
        raise NotImplementedError(
            f"{', '.join(given)} need {lack}. Remove them; {logged} are logged for train and eval."
        )


def _check_liger(args: Any) -> None:
    """``use_liger_kernel=True`` needs the ``liger-kernel`` package, which transformers' Trainer
    applies to the model's layers only when training starts; say so before any model loads.

    Raises:
        ImportError: ``use_liger_kernel=True`` and ``liger-kernel`` is not installed.
    """
    if not getattr(args, "use_liger_kernel", False):
        return
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise ImportError(
            "use_liger_kernel=True needs the liger-kernel package (pip install liger-kernel; its Triton kernels "
            "run on a GPU), which is not installed. Set use_liger_kernel=False: posttrain's own loss already "
            "computes the log-probs in chunks without building the [batch, length, vocabulary] logits."
        )


class _Guards(TrainerCallback):
    """Calls the trainer's guards and per-step hooks at the right moments of the loop."""

    def __init__(self, trainer: BaseTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._use_selective_checkpointing()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._check_gradients()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._after_optimizer_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._on_train_end()
        if state.is_world_process_zero and state.log_history:
            self.trainer._write_plots()
