"""REINFORCE Leave-One-Out (RLOO) and REINFORCE++."""
