"""posttrain.ops."""
