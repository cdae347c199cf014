"""Structured outputs: grammars through xgrammar (grammar.py) and their part in the step (extension.py)."""
