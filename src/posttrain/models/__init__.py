"""posttrain.models."""
