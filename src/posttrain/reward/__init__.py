"""Reward modelling: a sequence classifier trained on preference pairs (``RewardConfig``, ``RewardTrainer``)."""
