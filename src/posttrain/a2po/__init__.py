"""A*-PO (Optimal Advantage Regression): ``A2POConfig``, ``A2POTrainer`` and the pure math."""
