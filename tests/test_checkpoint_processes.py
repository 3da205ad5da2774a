"""Checkpoints under real process failures and memory limits (subprocesses, real files)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardvar
from shardvar import Layout

# A zygote imports torch and shardvar once, then forks one saver per trial (each a real process,
# killed with a real SIGKILL mid-save): a fresh interpreter per trial cost ~2 s of imports.
SAVER = textwrap.dedent(
    """
    import os, sys, torch, shardvar
    from shardvar import Layout
    path = sys.argv[1]

    def save_forever(version):
        print("ready", os.getpid(), flush=True)
        while True:
            value = float(version)
            state = {
                "table": shardvar.shard_tensor(torch.full((4096, 256), value), Layout.mod(4096, 8)),
                "dense": torch.full((2048, 512), value),
                "step": torch.tensor(value),
            }
            shardvar.save(state, path)
            print(version, flush=True)
            version += 1

    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            save_forever(int(line))
        _, status = os.waitpid(pid, 0)
        print("dead", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    """
)


def versions_in(path) -> set[float]:
    table = shardvar.shard_tensor(torch.zeros(4096, 256), Layout.div(4096, 3))
    dense, step = torch.zeros(2048, 512), torch.tensor(0.0)
    shardvar.load({"table": table, "dense": dense, "step": step}, path)
    return {*table.to_tensor().unique().tolist(), *dense.unique().tolist(), float(step)}


def run_trials(path, trials: int, rng: random.Random) -> None:
    version, on_disk = 1, 0.0
    with subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as zygote:
        for _ in range(trials):
            zygote.stdin.write(f"{version}\n")
            zygote.stdin.flush()
            ready, pid = zygote.stdout.readline().split()
            assert ready == "ready", ready
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(int(pid), signal.SIGKILL)
            finished = []
            while (line := zygote.stdout.readline().split())[0] != "dead":
                finished.append(int(line[0]))
            assert line == ["dead", str(int(signal.SIGKILL))], line  # killed mid-loop, not failed
            last_complete = finished[-1] if finished else on_disk
            found = versions_in(path)  # must load, complete, with one consistent version
            assert len(found) == 1, found
            (v,) = found
            assert v in (last_complete, version + len(finished)), (v, last_complete)  # old, or the save in flight
            on_disk, version = v, version + len(finished) + 1
        zygote.stdin.close()
        assert zygote.wait(timeout=60) == 0


def test_sigkill_during_save_leaves_old_or_new_checkpoint(tmp_path) -> None:
    # Two runners at a time (the machine has 2 cores), 12 kills each: 24 trials.
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    for path in (path_a, path_b):
        shardvar.save(
            {
                "table": shardvar.shard_tensor(torch.zeros(4096, 256), Layout.mod(4096, 8)),
                "dense": torch.zeros(2048, 512),
                "step": torch.tensor(0.0),
            },
            path,
        )
    import threading

    errors = []

    def runner(path, seed):
        try:
            run_trials(path, 12, random.Random(seed))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=runner, args=(p, i)) for i, p in enumerate((path_a, path_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    leftovers = [p.name for p in path_a.iterdir() if p.name != "manifest.json"]
    assert len(leftovers) >= 1  # the committed save's data (a crashed save's files go at the next save)


RESTORER = textwrap.dedent(
    """
    import os, resource, sys
    import torch, shardvar
    from shardvar import Layout
    torch.set_num_threads(1)
    src, dst, rows, cols, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    try:
        torch.empty(rows, cols)  # the whole variable must not fit
        print("whole variable fits: the limit is too loose"); sys.exit(3)
    except (RuntimeError, MemoryError):
        pass
    target = Layout.mod(rows, 8)
    for s in range(8):
        shard = shardvar.read_shard(src, "big", target, s)
        ids = target.shard_ids(s).float()
        assert torch.equal(shard[:, 0], ids) and torch.equal(shard[:, 5], ids + 5 / cols), s
        del shard
    shardvar.reshard(src, dst, 8, "mod")
    print("ok", flush=True)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc to read the address-space size")
def test_restore_a_variable_larger_than_the_memory_limit(tmp_path) -> None:
    rows, cols = 1 << 18, 256  # 256 MiB of float32: more than the headroom below, and 8 shards of 32 MiB
    headroom = 160 << 20  # the restoring process may allocate 160 MiB more than it has after importing torch
    full = torch.arange(rows, dtype=torch.float32).unsqueeze(1) + torch.arange(cols, dtype=torch.float32) / cols
    shardvar.save({"big": shardvar.shard_tensor(full, Layout.div(rows, 8))}, tmp_path / "src")
    target = Layout.mod(rows, 8)
    del full
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            RESTORER,
            str(tmp_path / "src"),
            str(tmp_path / "dst"),
            str(rows),
            str(cols),
            str(headroom),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
    assert shardvar.checkpoint.Manifest.read(tmp_path / "dst").variables["big"].layout == target
    check = torch.zeros(rows, cols)
    shardvar.load({"big": check}, tmp_path / "dst", staging_bytes=0)
    assert float(check[12345, 7]) == 12345 + 7 / cols
