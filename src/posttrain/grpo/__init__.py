"""posttrain.grpo."""
