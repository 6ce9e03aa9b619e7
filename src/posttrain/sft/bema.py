"""BEMA: bias-corrected exponential moving average of the weights, as a trainer callback.

Block & Zhang 2025, "EMA Without the Lag: Bias-Corrected Iterate Averaging Schemes". From the
burn-in step ``tau`` (``update_after``) on, every ``update_freq`` steps, with ``t`` the steps
since ``tau``:

    beta_t  = max((lag + multiplier * t) ** -ema_power, min_ema_multiplier)
    alpha_t = (lag + multiplier * t) ** -bias_power
    EMA_t   = (1 - beta_t) * EMA_prev + beta_t * theta_t          (EMA_tau = theta_tau)
    BEMA_t  = EMA_t + alpha_t * (theta_t - theta_tau)

The training run itself is untouched; the BEMA weights are kept aside and saved at the end.

Departures from the reference (TRL 1.16's ``BEMACallback``), both towards the paper:

* ``t`` counts from ``update_after`` (the paper's tau), not from step 0, so a burn-in does
  not shrink the first coefficients.
* Only trainable parameters are tracked, matched by name, so frozen parameters (PEFT adapters
  on a frozen base, frozen embeddings) do not break the pairing; no second model is kept.

The EMA and BEMA buffers are float32 on ``device`` whatever the parameters' dtype; theta_tau
keeps the parameters' dtype (it is an exact copy).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

#: File, inside each ``checkpoint-<step>`` folder, that holds the callback's buffers for resuming.
STATE_FILE = "bema_state.pt"
#: Folder, inside ``output_dir``, where the BEMA weights are saved at the end of training.
BEMA_DIR = "bema"


def bema_coefficients(
    t: int, *, lag: float, multiplier: float, ema_power: float, bias_power: float, min_ema_multiplier: float
) -> tuple[float, float]:
    """The EMA weight ``beta_t`` and the bias-correction weight ``alpha_t`` at ``t`` steps after tau."""
    base = lag + multiplier * t
    return max(base**-ema_power, min_ema_multiplier), base**-bias_power


@torch.no_grad()
def bema_step(
    theta: torch.Tensor, theta0: torch.Tensor, ema: torch.Tensor, beta: float, alpha: float
) -> torch.Tensor:
    """Update ``ema`` in place with ``theta`` and return the BEMA weights.

    Args:
        theta: the current weights (any device; cast to ``ema``'s device and dtype).
        theta0: the weights at tau.
        ema: the running EMA, updated in place: ``(1 - beta) * ema + beta * theta``.
        beta: the EMA weight at this step.
        alpha: the bias-correction weight at this step.

    Returns:
        ``ema + alpha * (theta - theta0)``, a new tensor like ``ema``.
    """
    theta = theta.detach().to(device=ema.device, dtype=ema.dtype)
    ema.mul_(1.0 - beta).add_(theta, alpha=beta)
    return ema + alpha * (theta - theta0.to(ema.dtype))


class BEMACallback(TrainerCallback):
    """Keep BEMA weights of the trainable parameters and save them at the end of training.

    Args:
        update_freq: update every this many optimizer steps (the paper's phi).
        ema_power: kappa, the EMA weight's decay power (0 disables the averaging: beta = 1).
        bias_power: eta, the bias correction's decay power (0 keeps alpha = 1).
        lag: rho, the virtual age at tau that damps the first updates.
        update_after: tau, the burn-in: theta_tau and the EMA are taken at this step, and ``t``
            counts from it.
        multiplier: gamma, the speed of the schedules' decay.
        min_ema_multiplier: a floor for beta.
        device: where the buffers live (keep them off the accelerator to save its memory).

    Saved files:
        ``{output_dir}/bema``: at the end of training, the model's ``save_pretrained`` folder
        with the BEMA weights in place of the trainable parameters (for a PEFT model, the
        adapter folder); a model without ``save_pretrained`` gets ``model.pt`` (its
        ``state_dict``). The processing class is saved there too when the trainer has one.
        ``{checkpoint}/bema_state.pt``: at every checkpoint, the buffers and counters, read
        back when training resumes from that checkpoint of ``output_dir``.
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
    ) -> None:
        _check_hyperparameters(
            update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
        )
        self.update_freq = update_freq
        self.ema_power = ema_power
        self.bias_power = bias_power
        self.lag = lag
        self.update_after = update_after
        self.multiplier = multiplier
        self.min_ema_multiplier = min_ema_multiplier
        self.device = torch.device(device)
        self._reset()

    def _reset(self) -> None:
        """Forget every buffer (a new run)."""
        self.names: list[str] = []
        self.theta0: dict[str, torch.Tensor] = {}
        self.ema: dict[str, torch.Tensor] = {}
        self.bema: dict[str, torch.Tensor] = {}
        self.start_step: int | None = None  # the global step taken as tau
        self.last_update_step: int | None = None
        self.num_updates = 0

    # ------------------------------------------------------------------ the schedule

    def coefficients(self, t: int) -> tuple[float, float]:
        """``(beta_t, alpha_t)`` at ``t`` steps after tau."""
        return bema_coefficients(
            t,
            lag=self.lag,
            multiplier=self.multiplier,
            ema_power=self.ema_power,
            bias_power=self.bias_power,
            min_ema_multiplier=self.min_ema_multiplier,
        )

    def snapshot(self, model: torch.nn.Module, step: int) -> None:
        """Take theta_tau and start the EMA from the model's current trainable weights."""
        params = _trainable(model)
        self.names = list(params)
        self.theta0 = {n: p.detach().to(self.device).clone() for n, p in params.items()}
        self.ema = {n: p.detach().to(self.device, torch.float32).clone() for n, p in params.items()}
        self.bema = {}
        self.start_step, self.last_update_step, self.num_updates = step, None, 0

    def update(self, model: torch.nn.Module, step: int) -> None:
        """One BEMA update with the model's current weights at global step ``step``."""
        params = _named(model, self.names)
        beta, alpha = self.coefficients(step - self.start_step)
        self.bema = {n: bema_step(params[n], self.theta0[n], self.ema[n], beta, alpha) for n in self.names}
        self.last_update_step = step
        self.num_updates += 1
        logger.info("BEMA update %d at step %d (beta=%.4g, alpha=%.4g)", self.num_updates, step, beta, alpha)

    def bema_state_dict(self) -> dict[str, torch.Tensor]:
        """The latest BEMA weights of the tracked parameters, by name (empty before the first update)."""
        return dict(self.bema)

    # ------------------------------------------------------------------ trainer hooks

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Start tracking: resume the buffers of the checkpoint, or take theta_tau now if tau is 0."""
        self._reset()
        model = _unwrap(model)
        step = int(state.global_step)
        if step > 0 and self._resume(args, step, model):
            return
        if step > self.update_after:
            warnings.warn(
                f"BEMA: training resumes at step {step} without {STATE_FILE} in its checkpoint, so the average "
                f"restarts here (tau = {step}, not update_after={self.update_after}). Resume from a checkpoint "
                "saved with BEMACallback to continue the average.",
                stacklevel=2,
            )
            self.snapshot(model, step)
        elif step == self.update_after:
            self.snapshot(model, step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Take theta_tau at step ``update_after``; update every ``update_freq`` steps after it."""
        step = int(state.global_step)
        if self.start_step is None:
            if step >= self.update_after:
                self.snapshot(_unwrap(model), step)
            return
        t = step - self.start_step
        if t > 0 and t % self.update_freq == 0:
            self.update(_unwrap(model), step)

    def save_checkpoint_state(self, folder: str, state: Any) -> None:
        """Write the buffers into a checkpoint folder being staged (posttrain's trainers call this
        before the folder is published, so the checkpoint is whole with them or absent)."""
        if not getattr(state, "is_world_process_zero", True) or self.start_step is None:
            return
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(folder, STATE_FILE))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the buffers into the checkpoint folder, for resuming, under a trainer that did not
        already write them while staging it (a plain ``transformers.Trainer``)."""
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isfile(os.path.join(folder, STATE_FILE)):
            self.save_checkpoint_state(folder, state)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Save the BEMA weights to ``{output_dir}/bema``."""
        if not getattr(state, "is_world_process_zero", True):
            return
        model = _unwrap(model)
        if not self.bema:
            warnings.warn(
                f"BEMA: no update happened (global step {state.global_step}, first update at step "
                f"{(self.start_step if self.start_step is not None else self.update_after) + self.update_freq}), "
                f"so {args.output_dir}/{BEMA_DIR} holds the final weights. Lower update_freq or update_after.",
                stacklevel=2,
            )
        self.save(model, os.path.join(args.output_dir, BEMA_DIR), kwargs.get("processing_class"))

    # ------------------------------------------------------------------ saving and resuming

    @torch.no_grad()
    def save(self, model: torch.nn.Module, folder: str, processing_class: Any = None) -> None:
        """Save ``model`` with the BEMA weights swapped in, then put its own weights back."""
        params = _named(model, list(self.bema))
        backup = {n: params[n].detach().clone() for n in self.bema}
        try:
            for n, w in self.bema.items():
                params[n].copy_(w.to(params[n].device, params[n].dtype))
            os.makedirs(folder, exist_ok=True)
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(folder)
            else:
                torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
        finally:
            for n, w in backup.items():
                params[n].copy_(w)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(folder)
        logger.info("Saved the BEMA weights to %s", folder)

    def state_dict(self) -> dict[str, Any]:
        """Buffers and counters, for a checkpoint."""
        return {
            "names": list(self.names),
            "theta0": self.theta0,
            "ema": self.ema,
            "bema": self.bema,
            "start_step": self.start_step,
            "last_update_step": self.last_update_step,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, Any], model: torch.nn.Module | None = None) -> None:
        """Restore ``state_dict()``; with ``model``, check the tracked names are still trainable there."""
        if model is not None:
            missing = sorted(set(state["names"]) - set(_trainable(model)))
            if missing:
                raise ValueError(
                    f"BEMA state tracks parameters the model no longer trains: {missing[:5]} (of {len(missing)}). "
                    "Resume with the same model and frozen parameters, or start the run afresh."
                )
        self.names = list(state["names"])
        self.theta0 = {n: t.to(self.device) for n, t in state["theta0"].items()}
        self.ema = {n: t.to(self.device) for n, t in state["ema"].items()}
        self.bema = {n: t.to(self.device) for n, t in state["bema"].items()}
        self.start_step = state["start_step"]
        self.last_update_step = state["last_update_step"]
        self.num_updates = state["num_updates"]

    def _resume(self, args: Any, step: int, model: torch.nn.Module) -> bool:
        """Load the buffers saved in ``{output_dir}/checkpoint-{step}``; False when there are none."""
        path = os.path.join(args.output_dir, f"checkpoint-{step}", STATE_FILE)
        if not os.path.isfile(path):
            return False
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=True), model)
        logger.info("Resumed the BEMA state from %s", path)
        return True


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that require gradients, by name."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("BEMACallback found no trainable parameter in the model; it has nothing to average.")
    return params


def _named(model: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Parameter]:
    """The model's parameters of the given names (all of them must exist)."""
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(
            f"BEMA tracks parameters the model does not have: {missing[:5]}. The model changed after training "
            "began; keep its structure fixed while BEMACallback runs."
        )
    return {n: params[n] for n in names}


def _unwrap(model: Any) -> torch.nn.Module:
    """The bare model inside DDP / DataParallel / DeepSpeed wrappers."""
    if model is None:
        raise ValueError("BEMACallback needs the model; use it as a transformers Trainer callback.")
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _check_hyperparameters(
    update_freq: int,
    ema_power: float,
    bias_power: float,
    lag: float,
    update_after: int,
    multiplier: float,
    min_ema_multiplier: float,
) -> None:
    """Raise a ValueError naming the first out-of-range hyperparameter."""
    rules = [
        ("update_freq", update_freq, isinstance(update_freq, int) and update_freq >= 1, "an integer >= 1"),
        (
            "update_after",
            update_after,
            isinstance(update_after, int) and update_after >= 0,
            "an integer >= 0",
        ),
        ("ema_power", ema_power, ema_power >= 0, ">= 0"),
        ("bias_power", bias_power, bias_power >= 0, ">= 0"),
        ("lag", lag, lag >= 0, ">= 0"),
        ("multiplier", multiplier, multiplier > 0, "> 0"),
        ("min_ema_multiplier", min_ema_multiplier, 0 <= min_ema_multiplier <= 1, "in [0, 1]"),
    ]
    for name, value, ok, need in rules:
        if not ok:
            raise ValueError(f"BEMACallback({name}={value!r}): {name} must be {need}.")
