"""Speculative decoding: draftless proposers (proposers.py) and their part in the step (extension.py)."""
