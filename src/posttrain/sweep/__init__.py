"""Sweeps: several GRPO runs trained at once, each its own LoRA adapter on one base model (docs/sweeps.md)."""

from posttrain.sweep.runner import SHARED_FIELDS, GRPOSweep, RunOutcome, SweepRun, save_adapter

__all__ = ["SHARED_FIELDS", "GRPOSweep", "RunOutcome", "SweepRun", "save_adapter"]
