"""Checkpoints attacked: damaged and hostile manifests, links, FIFOs, dtypes, optimizer state.

Every attack must end in a CheckpointError (or a correct load) and leave every target as it was.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import shardvar
from shardvar import CheckpointError, Layout
from shardvar.checkpoint._manifest import _checksum
from shardvar.checkpoint._safetensors import DTYPE_CODES, FileWriter, StoredTensor, read_chunks


def saved(tmp_path: Path) -> Path:
    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-8)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    v = shardvar.shard_tensor(torch.arange(40.0).reshape(20, 2), Layout.mod(20, 3))
    shardvar.save({"v": v, "model": model, "opt": opt}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def targets():
    model = nn.Sequential(nn.Linear(3, 2))
    return {
        "v": shardvar.shard_tensor(torch.full((20, 2), -1.0), Layout.div(20, 4)),
        "model": model,
        "opt": torch.optim.Adam(model.parameters(), lr=0.5),
    }


def snapshot(objects: dict) -> list:
    out = [objects["v"].to_tensor().clone()]
    out += [p.detach().clone() for p in objects["model"].parameters()]
    return [*out, objects["opt"].param_groups[0]["lr"], len(objects["opt"].state)]


def assert_unchanged(objects: dict, before: list) -> None:
    for a, b in zip(snapshot(objects), before, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_every_byte_of_the_manifest_is_verified(tmp_path) -> None:
    directory = saved(tmp_path)
    path = directory / "manifest.json"
    original = path.read_bytes()
    rng = random.Random(0)
    positions = rng.sample(range(len(original)), 300)
    outcomes = {"refused": 0, "same": 0}
    for pos in positions:
        raw = bytearray(original)
        raw[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        objects = targets()
        before = snapshot(objects)
        try:
            shardvar.load(objects, directory)
        except CheckpointError:
            outcomes["refused"] += 1
            assert_unchanged(objects, before)
            continue
        outcomes["same"] += 1  # only a flip that changes no value (whitespace) may load, and loads right
        assert torch.equal(objects["v"].to_tensor(), torch.arange(40.0).reshape(20, 2))
        assert objects["opt"].param_groups[0]["lr"] == 0.01
    path.write_bytes(original)
    assert outcomes["refused"] >= 280, outcomes


def test_a_changed_hyper_parameter_refuses_to_load(tmp_path) -> None:
    directory = saved(tmp_path)
    path = directory / "manifest.json"
    path.write_text(path.read_text().replace('"lr": 0.01', '"lr": 0.0').replace('"eps": 1e-08', '"eps": 1e-09'))
    objects = targets()
    before = snapshot(objects)
    with pytest.raises(CheckpointError, match="checksum does not match"):
        shardvar.load(objects, directory)
    assert_unchanged(objects, before)


def resign(directory: Path, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = _checksum({k: v for k, v in manifest.items() if k != "checksum"})
    path.write_text(json.dumps(manifest))


def piece(m: dict) -> dict:
    return m["variables"]["v"]["pieces"][0]


HOSTILE = {
    "negative-start": (lambda m: piece(m).update(start=-1), "start must be an integer"),
    "float-count": (lambda m: piece(m).update(count=7.0), "count must be an integer"),
    "bool-step": (lambda m: piece(m).update(step=True), "step must be an integer"),
    "huge-begin": (lambda m: piece(m).update(begin=10**40), "begin must be an integer"),
    "string-shape": (lambda m: m["variables"]["v"].update(shape="20,2"), "shape must be a list"),
    "string-variables": (lambda m: m.update(variables="v"), "'variables' must be objects"),
    "list-piece": (lambda m: m["variables"]["v"]["pieces"].__setitem__(0, [1, 2]), "a piece must have exactly"),
    "extra-field": (lambda m: m["variables"]["v"].update(owner="root"), "must have exactly the fields"),
    "checksum-out-of-range": (lambda m: piece(m).update(xxh3_64=[2**64]), "xxh3_64 must be an integer"),
    "checksum-of-another-version": (lambda m: piece(m).update(crc32=piece(m).pop("xxh3_64")), "exactly the fields"),
    "declared-64-gib": (
        lambda m: m["variables"]["v"].update(
            shape=[2**31, 8], layout={"strategy": "div", "sizes": [2**31], "axis": 0}
        ) or m["variables"]["v"].update(pieces=[{**piece(m), "start": 0, "step": 1, "count": 2**31, "shape": [2**31, 8],
                                                  "xxh3_64": [0] * -(-(2**31) // piece(m)["chunk_rows"])}]),
        "was saved as torch.float32 \\[2147483648, 8\\]",
    ),
    "bad-save-id": (lambda m: m.update(save_id="../../x"), "save_id must be a hex string"),
    "unknown-dtype": (lambda m: m["variables"]["v"].update(dtype="object"), "unknown dtype 'object'"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifests_are_refused_before_anything_is_allocated(tmp_path, name) -> None:
    change, match = HOSTILE[name]
    directory = saved(tmp_path)
    resign(directory, change)
    objects = targets()
    before = snapshot(objects)
    with pytest.raises(CheckpointError, match=match):
        shardvar.load(objects, directory)
    assert_unchanged(objects, before)
    with pytest.raises(CheckpointError):  # with no target to compare, the files' real sizes refuse it
        shardvar.read_shard(directory, "v")


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"a": NaN}', "does not parse"),
        ('{"a": Infinity}', "does not parse"),
        ('{"a": ' + "9" * 5000 + "}", "does not parse"),
        ("[" * 100_000 + "]" * 100_000, "does not parse"),
        ('{"format": "shardvar-checkpoint", "format": "x"}', "does not parse"),
        ("\xff\xfe", "does not parse"),
    ],
)
def test_unparseable_manifests(tmp_path, text, match) -> None:
    directory = saved(tmp_path)
    (directory / "manifest.json").write_bytes(
        text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe"
    )
    with pytest.raises(CheckpointError, match=match):
        shardvar.load(targets(), directory)


def test_links_out_of_the_checkpoint_are_never_followed(tmp_path) -> None:
    directory = saved(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious" * 1000)
    # A planted spare pointing outside: the next save must not write through it.
    (directory / "spare-0123456789abcdef.safetensors").symlink_to(outside)
    shardvar.save({"x": torch.ones(1000)}, directory)
    assert outside.read_bytes() == b"precious" * 1000
    shardvar.save({"x": torch.zeros(1000)}, directory)  # and clean-up removes links, not their targets
    assert outside.read_bytes() == b"precious" * 1000
    # A data file replaced by a link to another file (even /dev/zero) refuses to load.
    directory = saved(tmp_path / "b")
    data = next(directory.glob("data-*.safetensors"))
    data.rename(tmp_path / "moved.safetensors")
    data.symlink_to(tmp_path / "moved.safetensors")
    with pytest.raises(CheckpointError, match="symbolic link"):
        shardvar.load(targets(), directory)
    data.unlink()
    data.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="symbolic link"):
        shardvar.load(targets(), directory)
    # A symlinked manifest is refused too.
    manifest = directory / "manifest.json"
    manifest.rename(tmp_path / "m.json")
    manifest.symlink_to(tmp_path / "m.json")
    with pytest.raises(CheckpointError, match="symbolic link"):
        shardvar.load(targets(), directory)


def test_a_fifo_named_like_a_data_file_never_blocks(tmp_path) -> None:
    directory = saved(tmp_path)
    data = next(directory.glob("data-*.safetensors"))
    data.unlink()
    os.mkfifo(data)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_try_load(directory)), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "load blocked on a FIFO"
    assert outcome and "not a regular file" in outcome[0]


def _try_load(directory: Path) -> str:
    try:
        shardvar.load(targets(), directory)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_every_safetensors_dtype_round_trips(tmp_path) -> None:
    values = {}
    for dtype in DTYPE_CODES:
        base = torch.arange(12).reshape(6, 2) % 5
        values[str(dtype).removeprefix("torch.")] = (
            base.to(torch.float32).to(dtype) if dtype.is_floating_point else base.to(dtype)
        )
    shardvar.save({k: shardvar.shard_tensor(v, Layout.mod(6, 4)) for k, v in values.items()}, tmp_path / "c")
    for name, value in values.items():
        got = shardvar.read_shard(tmp_path / "c", name)
        assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8)), name
    assert len(values) >= 18


def test_complex128_is_refused_before_any_file_is_written(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"dtype torch.complex128, which a checkpoint cannot store"):
        shardvar.save({"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "d")
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_our_files_and_the_safetensors_package_read_each_other(tmp_path) -> None:
    tensors = {
        str(d).removeprefix("torch."): (torch.arange(8).reshape(4, 2) % 3).to(d)
        for d in DTYPE_CODES
        if d in (torch.float32, torch.bfloat16, torch.int8, torch.uint16, torch.uint64, torch.bool, torch.complex64)
    }
    ours = tmp_path / "ours.safetensors"
    with open(ours, "w+b") as f:
        writer = FileWriter(f, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()])
        stored = {k: writer.write(k, t) for k, t in tensors.items()}
        writer.close()
    with safe_open(str(ours), framework="pt") as f:
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t), k
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, str(theirs))
    header_len = int.from_bytes(theirs.read_bytes()[:8], "little")
    header = json.loads(theirs.read_bytes()[8 : 8 + header_len])
    with open(theirs, "rb") as f:
        for k, t in tensors.items():
            begin = 8 + header_len + header[k]["data_offsets"][0]
            info = StoredTensor(k, tuple(t.shape), t.dtype, begin, stored[k].chunk_rows, stored[k].sums)
            assert torch.equal(read_chunks(f, info, 0, 0), t), k  # same bytes, same checksums


def test_optimizer_state_is_never_lost_silently(tmp_path) -> None:
    model, extra = nn.Linear(3, 2), nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([*model.parameters(), extra], lr=0.1)
    (model(torch.ones(1, 3)).sum() + extra.sum()).backward()
    opt.step()
    shardvar.save({"model": model, "opt": opt}, tmp_path / "e")
    model2, extra2 = nn.Linear(3, 2), nn.Parameter(torch.ones(4))
    opt2 = torch.optim.Adam([*model2.parameters(), extra2], lr=0.1)
    shardvar.load({"model": model2, "opt": opt2}, tmp_path / "e")
    assert len(opt2.state) == 3  # the module's two parameters and the extra one
    torch.testing.assert_close(opt2.state[extra2]["exp_avg"], opt.state[extra]["exp_avg"])
    # Optimizer state without its model: the parameters cannot be named alike.
    lonely = torch.optim.Adam(nn.Linear(3, 2).parameters())
    with pytest.raises(CheckpointError, match="load the model in the same call"):
        shardvar.load({"opt": lonely}, tmp_path / "e")
    assert not lonely.state
    # An Adam checkpoint into SGD (or the reverse) is refused before anything is written.
    model3 = nn.Linear(3, 2)
    before = model3.weight.detach().clone()
    sgd = torch.optim.SGD([*model3.parameters(), nn.Parameter(torch.ones(4))], lr=0.1, momentum=0.9)
    with pytest.raises(
        CheckpointError, match=r"saved as torch\.optim\.adam\.Adam; the target is torch\.optim\.sgd\.SGD"
    ):
        shardvar.load({"model": model3, "opt": sgd}, tmp_path / "e")
    assert torch.equal(model3.weight, before) and not sgd.state


def test_inspect_escapes_names_and_reshard_reports_damage(tmp_path) -> None:
    shardvar.save({"evil\x1b[2J\x07name": torch.ones(2)}, tmp_path / "f")
    out = subprocess.run(
        [sys.executable, "-m", "shardvar", "inspect", str(tmp_path / "f")], capture_output=True, text=True
    )
    assert out.returncode == 0 and "\x1b" not in out.stdout and "\\x1b[2J\\x07" in out.stdout, out.stdout
    directory = saved(tmp_path)
    (directory / "manifest.json").write_text("{broken")
    out = subprocess.run(
        [sys.executable, "-m", "shardvar", "reshard", str(directory), str(tmp_path / "g"), "--shards", "2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "does not parse as JSON" in out.stderr and "Traceback" not in out.stderr
    good = saved(tmp_path / "h")
    shardvar.reshard(good, tmp_path / "i", 2)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        shardvar.reshard(good, tmp_path / "i", 3)
    shardvar.reshard(good, tmp_path / "i", 3, overwrite=True)


def test_loads_are_quick_to_refuse_a_truncated_file(tmp_path) -> None:
    directory = saved(tmp_path)
    data = next(directory.glob("data-*.safetensors"))
    os.truncate(data, 100)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="truncated"):
        shardvar.read_shard(directory, "v")
    assert time.monotonic() - start < 5
