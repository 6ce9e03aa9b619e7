"""Direct Preference Optimization and its family: the pure loss table (``losses``)."""
