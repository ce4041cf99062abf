"""A causal-LM distillation example on the Python standard library's own source (see README.md)."""
