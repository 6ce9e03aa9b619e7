"""Supervised fine-tuning: the SFT losses (NLL, DFT) and the BEMA weight-averaging callback."""
