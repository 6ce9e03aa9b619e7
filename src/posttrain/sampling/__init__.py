"""The online sampling pipeline shared by GRPO and every trainer that samples while it trains."""
