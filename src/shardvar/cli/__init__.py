"""The ``shardvar`` command line: argument parsing, printing, and calls into ``shardvar.workloads``."""

from ._args import integer, real
from ._console import print_table
from ._main import main

__all__ = ["integer", "main", "print_table", "real"]
