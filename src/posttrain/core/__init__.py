"""What every trainer shares: the base config, the base trainer, the batch containers."""
