"""The README's Python examples run, and its set-up commands are the ones CI uses."""

from __future__ import annotations

import re

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_python_blocks_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks may write files
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_starts_with_exactly_two_setup_commands() -> None:
    blocks = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
    first_two = [body.strip() for _, body in blocks[:2]]
    assert first_two[0] == "pip install torch==2.13.0 -e . && shardvar demo"
    assert first_two[1].startswith('pip install torch==2.13.0 -e ".[test]"')
    assert all("\n" not in c for c in first_two)
    assert README.index(blocks[0][1]) < README.index("## ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".\\[test\\]"' in ci


def test_shell_blocks_run(tmp_path) -> None:
    import subprocess

    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)[2:]  # the first two are the set-up commands
    assert blocks
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for block in blocks:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0, block + out.stderr
