"""posttrain.generation."""
