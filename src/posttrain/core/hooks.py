"""The hooks a trainer family may override, declared in one place.

A family is a folder with a config and a trainer on the core (``docs/architecture.md``). Its
trainer subclasses ``BaseTrainer`` (offline families) or ``OnlineTrainer`` (families that sample)
and overrides only the hooks listed here; everything else is the core's. ``FamilyHooks`` (here) are
``BaseTrainer``'s; ``sampling/hooks.py``'s ``OnlineFamilyHooks`` add ``OnlineTrainer``'s. ``tests/test_layering.py``
checks that no family overrides a private member of the core that is not declared here, so a
newcomer reads this file to know what a new trainer may change.

These are ``Protocol`` classes: documentation with types, not base classes to inherit.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class FamilyHooks(Protocol):
    """What an offline or online family may override in ``BaseTrainer``."""

    #: What the family trains: ``"causal_lm"`` (a language model) or ``"sequence_classification"``
    #: (one score per row: reward models); routes model loading.
    _model_kind: ClassVar[str]

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The family's loss for one micro-batch (transformers' hook; ``_refuse_outputs`` refuses
        ``return_outputs``, ``_plus_aux_loss`` adds the MoE router loss, ``_as_share_of_step``
        scales it to its share of the step)."""

    def _prepare_inputs(self, inputs: Any) -> Any:
        """transformers' hook: the collated micro-batch moved to the device (a typed container)."""

    def _set_signature_columns_if_needed(self) -> None:
        """transformers' hook: which dataset columns the collator keeps (posttrain keeps its own)."""

    def _batch_tokens(self, inputs: Any) -> int:
        """Tokens the model runs on for one micro-batch (for the FLOP count)."""

    def _after_optimizer_step(self) -> None:
        """Once-per-optimizer-step updates after the step's last micro-batch (TR-DPO sync, an EMA
        teacher, adaptive entropy, a weight push to vLLM)."""

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """The family's state beyond transformers' (files in the staged ``folder``; returns small
        JSON values for the completion mark). Call ``super()`` for the synced reference."""

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        """Restore what ``_save_extra_state`` saved. Call ``super()``."""


def hook_names(*protocols: type) -> frozenset[str]:
    """The names the hook protocols declare (methods, properties and class attributes)."""
    return frozenset(
        name
        for cls in protocols
        for name in (*vars(cls), *getattr(cls, "__annotations__", {}))
        if not name.startswith("__") and name not in ("_is_protocol", "_is_runtime_protocol", "_abc_impl")
    )
