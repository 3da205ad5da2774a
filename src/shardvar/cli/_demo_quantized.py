"""``shardvar demo --quantize``'s table: the trained model served with its tables at int8 and int4."""

from __future__ import annotations

from ._console import format_bytes, print_table

__all__ = ["print_quantized"]


def print_quantized(results: list[tuple[str, int, float]]) -> None:
    """The served model at each precision: table bytes and evaluation logloss against float32's."""
    _, base_bytes, base_loss = results[0]
    rows = [
        [label, format_bytes(n), f"{n / base_bytes:.3f}x", f"{loss:.5f}", f"{(loss - base_loss) / base_loss:+.3%}"]
        for label, n, loss in results
    ]
    headers = ["tables", "bytes", "vs float32", "eval logloss", "change"]
    print_table(headers, rows, title="served with quantized tables (shardvar.quantize)")
