"""Tool calls in a model's output (SGLang's function_call package): a detector per model format
(`--tool-call-parser`), the JSON-array parser of grammar-forced calls, and the grammars that force
them."""
