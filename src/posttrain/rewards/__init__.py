"""posttrain.rewards."""
