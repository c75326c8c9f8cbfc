"""Training helpers: checkpoints, export, distributed evaluation."""
