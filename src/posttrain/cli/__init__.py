"""posttrain.cli."""
