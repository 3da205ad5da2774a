"""Two ranks on two hosts: network namespaces joined by a veth pair, launched by torchrun.

Skipped, with the reason, where network namespaces cannot be created (no root, no iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardvar
from dist_workers import ROWS
from distributed import HERE, free_port
from test_distributed import single_process_reference


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b = f"sva{tag}", f"svb{tag}"
    made = _ip("netns", "add", a)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here ({made.stderr.strip()})")
    try:
        _ip("netns", "add", b)
        steps = [
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("link", "set", f"va{tag}", "netns", a),
            ("link", "set", f"vb{tag}", "netns", b),
            ("-n", a, "addr", "add", "10.231.7.1/24", "dev", f"va{tag}"),
            ("-n", b, "addr", "add", "10.231.7.2/24", "dev", f"vb{tag}"),
            ("-n", a, "link", "set", f"va{tag}", "up"),
            ("-n", b, "link", "set", f"vb{tag}", "up"),
            ("-n", a, "link", "set", "lo", "up"),
            ("-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ({' '.join(step)}: {out.stderr.strip()})")
        yield [(a, f"va{tag}", "10.231.7.1"), (b, f"vb{tag}", "10.231.7.2")]
    finally:
        _ip("netns", "del", a)
        _ip("netns", "del", b)


def test_two_hosts_train_like_one_process(tmp_path: Path, two_hosts) -> None:
    port = free_port()
    endpoint = f"{two_hosts[0][2]}:{port}"
    procs = []
    for node, (ns, device, address) in enumerate(two_hosts):
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": device,  # talk over the veth pair, as two hosts would
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        cmd = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", f"shardvar-{port}", "--rdzv-conf", f"is_host={int(node == 0)}",
            "--local-addr", address,
            str(HERE / "dist_workers.py"), "train",
            '{"strategy": "mod", "shards": 3, "steps": 10, "seed": 4}', str(tmp_path),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    firsts, table, _ = single_process_reference(2, "mod", 3, 10, 4)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["first"], firsts[rank], atol=1e-6, rtol=0)
    parts = {s: t for r in results for s, t in r["shards"].items()}
    logical = shardvar.ShardedVariable([parts[s] for s in range(3)], partition_strategy="mod").to_tensor()
    torch.testing.assert_close(logical, table, atol=1e-6, rtol=0)
    assert logical.shape[0] == ROWS
