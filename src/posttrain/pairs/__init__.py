"""The trainers on preference pairs share ``PairTrainer`` (``pairs/trainer.py``)."""
