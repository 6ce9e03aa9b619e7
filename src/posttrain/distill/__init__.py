"""Distillation: on-policy distillation and GKD, a student trained on a frozen teacher's token distributions."""
