"""Optimizers whose step is one fused hetcomm op: between the communication layer's
reduced gradient and the model's weights, with no host synchronisation."""

from hetcomm.optim.adamw import AdamW

__all__ = ["AdamW"]
