"""posttrain.data."""
