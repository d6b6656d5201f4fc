"""Constrained decoding: grammar backends (xgrammar, llguidance) and the packed vocabulary masks."""
