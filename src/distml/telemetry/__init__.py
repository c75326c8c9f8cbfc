"""Measuring the costs of distribution: communication, synchronisation wait, energy."""
