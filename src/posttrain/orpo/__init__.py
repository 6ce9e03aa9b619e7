"""Odds Ratio Preference Optimization; also what ORPO and CPO share (no reference model)."""
