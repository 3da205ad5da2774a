"""The demo's flags as the workload's settings, and where its checkpoint went."""

from __future__ import annotations

import argparse
import dataclasses

from ..workloads import DemoSettings

__all__ = ["settings_of", "where"]


def settings_of(args: argparse.Namespace) -> DemoSettings:
    """The workload's settings from the parsed flags."""
    return DemoSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoSettings)})


def where(args: argparse.Namespace, path: object) -> str:
    """Where the checkpoint went: its path when kept, else that it was removed."""
    return str(path) if args.checkpoint else "removed (--checkpoint DIR keeps it)"
