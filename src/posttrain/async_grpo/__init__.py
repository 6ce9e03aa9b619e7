"""Asynchronous GRPO: ``AsyncGRPOConfig``, ``AsyncGRPOTrainer``, the background sampler and the pure math."""
