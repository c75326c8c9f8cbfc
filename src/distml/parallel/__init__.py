"""Strategies applied to a plain model from outside."""
