"""Parsers of a model's output text that are not tool calls (SGLang's parser package)."""
