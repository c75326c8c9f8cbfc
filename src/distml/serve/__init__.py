"""Inference: generation with a model sharded over several processes."""
