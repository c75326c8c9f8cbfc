"""Federated learning: the data stays on its node; only model updates travel and are aggregated."""
