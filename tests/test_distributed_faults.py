"""After a ShardvarDistributedError every surviving process exits promptly, with and without torchrun.

The workers are user scripts (tests/dist_fault_workers.py): they let the error end them and go
through interpreter shutdown, where a gloo group with pending work used to wait for its own
timeout (minutes) before the process could exit. The three cases run at once to keep the suite short.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardvar
from conftest import ROOT
from dist_fault_workers import TIMEOUT
from distributed import HERE, free_port, run_ranks

SCRIPT = str(HERE / "dist_fault_workers.py")
STARTUP = 90.0  # two interpreters importing torch on a busy machine


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def _plain(scenario: str, out: Path) -> list[subprocess.Popen]:
    port, procs = free_port(), []
    for rank in range(2):
        env = _env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, SCRIPT, scenario, str(out)], env=env, stderr=subprocess.PIPE))
    return procs


def _torchrun(scenario: str, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           SCRIPT, scenario, str(out)]  # fmt: skip
    return subprocess.Popen(cmd, env=_env({}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _exit_delay(out: Path) -> float:
    """Seconds between rank 0 raising and its process being gone (waits at most STARTUP + TIMEOUT)."""
    marker, deadline = out / "raised0", time.monotonic() + STARTUP + TIMEOUT
    while not marker.exists():
        assert time.monotonic() < deadline, f"rank 0 never raised ShardvarDistributedError ({out})"
        time.sleep(0.1)
    raised = json.loads(marker.read_text())
    while _alive(raised["pid"]) and time.time() - raised["time"] < 40:
        time.sleep(0.1)
    return time.time() - raised["time"]


def _stopped_pid(out: Path) -> int:
    return int((out / "pid1").read_text())


def test_survivors_exit_promptly_after_a_hung_or_dead_peer(tmp_path: Path) -> None:
    cases = {name: tmp_path / name for name in ("hang", "save", "torchrun_hang")}
    for d in cases.values():
        d.mkdir()
    hang, save = _plain("hang", cases["hang"]), _plain("save", cases["save"])
    launcher = _torchrun("hang", cases["torchrun_hang"])
    try:
        for name, out in cases.items():
            # Within the timeout it stated: the backend gives up on the pending work with the wait.
            assert _exit_delay(out) <= TIMEOUT + 15, name  # slack for a busy machine; it was 120 s
        for name, procs in (("hang", hang), ("save", save)):
            assert procs[0].wait(timeout=5) == 1, name
            err = procs[0].stderr.read().decode()
            assert "ShardvarDistributedError" in err and f"{TIMEOUT:g} s timeout" in err, err
        os.kill(_stopped_pid(cases["torchrun_hang"]), signal.SIGKILL)  # torchrun would wait to SIGTERM it
        assert launcher.wait(timeout=60) != 0  # the launcher sees the failure: it can restart the job
    finally:  # the stopped ranks first: they hold the launcher's pipes open
        for name in ("hang", "torchrun_hang"):
            if (cases[name] / "pid1").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(_stopped_pid(cases[name]), signal.SIGKILL)
        for p in [*hang, *save, launcher]:
            p.kill()
            p.communicate()  # reaps it and closes its pipe


def disagreeing_tables(rank: int, world: int) -> dict[str, str | None]:
    """Worker (tests/dist_workers.py): collections whose ranks were given different tables."""
    from shardvar import TableConfig
    from shardvar.distributed import DistributedEmbeddingBagCollection

    small = TableConfig(50, 16)
    cases = {
        "num_embeddings": ({"small": small, "cat_1": TableConfig(1000 + rank, 16, 2)}, None),
        "mode": ({"small": small, "cat_2": TableConfig(60, 16, mode=["sum", "mean"][rank])}, None),
        "placement": ({"small": small, "cat_3": TableConfig(60, 16)}, {"cat_3": ["row", "table"][rank]}),
        "tables": ({"small": small, **({"extra": small} if rank else {})}, None),
    }
    errors: dict[str, str | None] = {}
    for case, (tables, placement) in cases.items():
        try:
            DistributedEmbeddingBagCollection(tables, placement=placement)
            errors[case] = None
        except shardvar.ShardvarDistributedError as e:
            errors[case] = str(e)
    return errors


def test_ranks_disagreeing_on_a_table_name_it_the_argument_and_both_values(tmp_path: Path) -> None:
    zero, one = run_ranks(2, "test_distributed_faults:disagreeing_tables", tmp_path)
    assert zero["num_embeddings"] == (
        "ranks disagree about table 'cat_1': num_embeddings is 1000 on rank 0 but 1001 on rank 1"
    )
    assert one["num_embeddings"] == (
        "ranks disagree about table 'cat_1': num_embeddings is 1001 on rank 1 but 1000 on rank 0"
    )
    assert zero["mode"] == "ranks disagree about table 'cat_2': mode is 'sum' on rank 0 but 'mean' on rank 1"
    assert zero["placement"] == (
        "ranks disagree about table 'cat_3': placement is 'row' on rank 0 but 'table' on rank 1"
    )
    assert zero["tables"] == (
        "ranks disagree about the collection's tables: ['small'] on rank 0 but ['small', 'extra'] on rank 1"
    )


def test_dlrm_refuses_a_batch_that_does_not_divide_by_the_world_size() -> None:
    from shardvar.workloads import build_dlrm, criteo_tables, train_dlrm

    configs = criteo_tables(0.0005, count=2)
    with pytest.raises(shardvar.ShardvarValueError, match=r"global batch \(65\) must divide by the number of proc"):
        train_dlrm(build_dlrm(configs, 1), configs, steps=1, size=65, lr=0.1, world=2)


def test_dlrm_ranks_that_run_different_numbers_of_steps_all_fail_clearly(tmp_path: Path) -> None:
    port, procs = free_port(), []
    for rank in range(2):
        env = _env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        cmd = [sys.executable, str(ROOT / "examples" / "dlrm.py"), "--steps", str(3 + rank), "--batch", "64",
               "--scale", "0.0005", "--timeout", "5", "--save", str(tmp_path / "ck")]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errors = []
    for p in procs:
        out, err = p.communicate(timeout=STARTUP + 60)
        assert p.returncode == 1, out + err
        errors.append(err.strip().splitlines()[-1])
    assert (
        "ranks stopped after different numbers of steps: this rank (0) finished its 3 steps and rank(s) [1] "
        in (errors[0])
    )
    assert "rank 0 stopped after 3 steps while this rank (1) was running step 4" in errors[1]
    assert not (tmp_path / "ck" / "manifest.json").exists()
