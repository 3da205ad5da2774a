"""The one place the roofline takes the shared benchmark helpers from (repointed when the harness leaves ``cli/``)."""

from __future__ import annotations

# Absolute: pytest's doctest collection imports this file alone while workloads/ has no __init__.py.
from shardvar.cli._bench import zipf_ids
from shardvar.cli._console import print_table

__all__ = ["print_table", "zipf_ids"]
