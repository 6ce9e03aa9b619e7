"""Contrastive Preference Optimization and its reference-free relatives (SimPO, AlphaPO)."""
