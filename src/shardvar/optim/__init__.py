"""Optimizers for tables: state laid out like the table, sparse updates of the touched rows.

``shardvar.optim.SGD/Adagrad/RowWiseAdagrad/Adam/RowWiseAdam(model_or_tables, ...)`` are
``torch.optim.Optimizer``s (learning-rate schedulers work) whose updates run once per slab; their
state is saved by ``shardvar.save`` as logical variables in the table's layout, so it reshards.
"""

from ._base import TableOptimizer
from ._fused import FusedHandle, fuse
from ._optimizers import SGD, Adagrad, Adam, RowWiseAdagrad, RowWiseAdam
from ._tables import Table, find_tables

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "RowWiseAdagrad",
    "RowWiseAdam",
    "Table",
    "TableOptimizer",
    "find_tables",
    "fuse",
    "FusedHandle",
]
