"""Predicting what a parallel layout costs before paying for it."""

from distml.layout import Layout
from distml.plan.cost_model import DEVICES, Cluster, ModelSpec, Prediction, Training, predict

__all__ = ["DEVICES", "Cluster", "Layout", "ModelSpec", "Prediction", "Training", "predict"]
