"""The roofline (issue 37): each hot path's bytes per second as a fraction of the machine's bandwidth.

    python benchmarks/bench_roofline.py [--rounds 5] [--threads N] [--dir DIR] [--json out.json] [--png out.png]
                                        [--quick]      # the same as: shardvar bench --view roofline ...

In one run: the memory bandwidth with torch on all threads (copy and triad, 256 MiB arrays, huge
pages off and on, a child process per setting), the disk's sequential write (+ fsync) and read
rate in ``--dir``, then, for each hot path, the bytes it must move divided by its median time,
as a fraction of the best copy bandwidth with huge pages on (checkpoints: of the disk's rate):
a 2^20 x 64 lookup of 2^20 Zipf ids, scatter_add, bag forward and forward+backward, fused
RowWiseAdagrad and RowWiseAdam steps of an 8 x 2^18 x 64 collection (batch 4096 x 20 Zipf ids),
int8 / int4 quantized bags, checkpoint save and restore. Where torch has the same op, its
fraction on the same bytes is printed beside. The byte model is documented once, in
``src/shardvar/workloads/_roofline.py``; the README's "Roofline" section summarises it.
"""

from __future__ import annotations

import sys

from shardvar.cli import main  # it sets torch's huge-page switch before torch's first allocation

if __name__ == "__main__":
    sys.exit(main(["bench", "--view", "roofline", *sys.argv[1:]]))
