"""examples/dlrm.py as a long run: periodic asynchronous checkpoints, a rank killed under
``torchrun --max-restarts``, and resuming at other world sizes (2 -> 3 -> 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

ARGS = ["--batch", "1536", "--scale", "0.0005", "--checkpoint-every", "5"]


def _launch(world: int, steps: int, root: Path, restarts: int = 0) -> subprocess.Popen:
    # --standalone: a c10d rendezvous. Its store is shared by every round (a restart) unless
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and torch's env:// init keys the group unprefixed in a
    # shared store: a restarted gloo rank could read a dead rank's address of the earlier round.
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                "--max-restarts", str(restarts)] if world > 1 else []  # fmt: skip
    cmd = [sys.executable, *launcher, str(ROOT / "examples" / "dlrm.py"), "--steps", str(steps), *ARGS,
           "--checkpoint-dir", str(root / "ck"), "--losses", str(root / "losses")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    return out


def _rank_pid(root: Path, rank: int) -> int | None:
    """The worker of ``rank`` training into ``root`` (a torchrun child), found in /proc."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        mine = str(root / "ck").encode() in cmdline and f"LOCAL_RANK={rank}".encode() in environ
        if mine and b"torch.distributed.run" not in cmdline:
            return int(proc.name)
    return None


def _losses(root: Path) -> list[tuple[int, str]]:
    return [(int(s), loss) for s, loss in (line.split() for line in (root / "losses").read_text().splitlines())]


def test_a_killed_rank_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    reference, run = _launch(2, 20, whole), _launch(2, 20, killed, restarts=1)
    try:
        first = killed / "ck" / "step-00000005" / "manifest.json"
        deadline = time.monotonic() + 240
        while not first.exists():
            assert time.monotonic() < deadline and run.poll() is None, "no checkpoint of step 5"
            time.sleep(0.05)
        pid = _rank_pid(killed, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # mid-run: its rank was training past step 5
        out = _finish(run)
        _finish(reference)
    finally:
        for p in (run, reference):
            if p.returncode is None:  # an assertion left it running
                p.kill()
                p.communicate()
    assert "dlrm: resuming from" in out, out
    want = dict(_losses(whole))
    got = _losses(killed)
    assert sorted(want) == list(range(20))
    assert {s for s, _ in got} == set(range(20))
    assert all(loss == want[s] for s, loss in got), (got, want)  # exactly, repeated steps included

    # The same checkpoints at other world sizes: 3 ranks go on to step 25, then one process to 28.
    out = _finish(_launch(3, 25, killed))
    assert "resuming from" in out and "step-00000020" in out, out
    out = _finish(_launch(1, 28, killed))
    assert "resuming from" in out and "step-00000025" in out, out
    assert [s for s, _ in _losses(killed)][-8:] == list(range(20, 28))
