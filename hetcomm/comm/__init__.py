"""Weighted gradient reduction over torch.distributed: a bucketed reducer for custom
training loops and a DDP communication hook. Knows nothing of models: it sees lists
of parameters and their gradients."""

from hetcomm.comm.collectives import CollectiveTimeout, LayoutMismatch
from hetcomm.comm.ddp_hook import WeightedHookState, weighted_hook
from hetcomm.comm.reducer import ReduceResult, WeightedReducer

__all__ = ["WeightedReducer", "ReduceResult", "WeightedHookState", "weighted_hook", "CollectiveTimeout",
           "LayoutMismatch"]
