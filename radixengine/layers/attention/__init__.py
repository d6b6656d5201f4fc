"""Attention backends (`attention_registry` picks one by `--attention-backend`) and their kernels."""
