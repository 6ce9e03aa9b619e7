"""posttrain.observe."""
