"""bench/gpu_kit.sh and bench/gpu_before_after.sh, a lent GPU's one call rehearsed on a CPU: the kit lightens a copy
of this checkout to what fits the device tool's 64 MiB and puts it back; the files that would travel, copied
apart as the device gets them, run both engines' bench with the kit's wheels installed as the device installs them.

Slow: the kit fetches its wheels from the package registry (about 3 MB), and the rehearsal runs the bench twice
(about 20 s). The fast tests of gpu.py itself: tests/test_bench_gpu.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import subprocess_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def tracked(repo: Path) -> list[str]:
    return git(repo, "ls-files", "-z").split("\0")[:-1]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """This checkout's files, tracked and untracked-not-ignored, as the one commit of a repository of its own (the
    kit's BEFORE is that commit: the rehearsal tests the mechanics, not issue 69's history)."""
    repo = tmp_path / "repo"
    for name in travelling(REPO):
        if (REPO / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, repo / name)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "the checkout")
    return repo


def travelling(repo: Path) -> list[str]:
    """What a device call sends: the tracked files and the untracked ones git does not ignore (the kit, carried)."""
    others = git(repo, "ls-files", "-z", "--others", "--exclude-standard").split("\0")[:-1]
    return tracked(repo) + others


def test_the_kit_fits_the_call_and_the_rehearsal_times_both_engines(checkout, tmp_path):
    # (the wheels for this Python, which the rehearsal installs them into, where a device's image runs 3.12)
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                         DEVICE_PYTHON=f"{sys.version_info.major}.{sys.version_info.minor}")
    whole = sum((checkout / n).stat().st_size for n in tracked(checkout))
    kit = subprocess.run(["bash", "bench/gpu_kit.sh", "HEAD"], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=300)
    assert kit.returncode == 0, kit.stderr
    sent = [line for line in kit.stdout.splitlines() if line.startswith("a call sends")]
    assert sent and float(sent[0].split()[3]) < 64, kit.stdout

    # lightened: the checkpoints out of the index but on disk, the kit ignored, and what travels under 64 MiB
    light = travelling(checkout)
    assert not any(n.startswith("exitbench/checkpoints/") for n in light)
    assert (checkout / "exitbench/checkpoints/tiny-raven/model.safetensors").is_file()
    kit_bytes = sum(p.stat().st_size for p in (checkout / ".device").rglob("*") if p.is_file())
    assert sum((checkout / n).stat().st_size for n in light) + kit_bytes < 64 * MIB < whole + kit_bytes
    assert sorted(p.name.split("-")[0] for p in (checkout / ".device/wheels").iterdir()) == \
        ["annotated_types", "pydantic", "pydantic_core", "typing_extensions", "typing_inspection"]

    # the device's copy: the files that travel and the carried kit, nothing else
    device = tmp_path / "device"
    for name in light:
        (device / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(checkout / name, device / name)
    shutil.copytree(checkout / ".device", device / ".device")
    out = tmp_path / "out"
    out.mkdir()
    args = (f"--device cpu --checkpoint {checkout / 'exitbench/checkpoints/tiny-raven'} --tokens 2 --max-steps 4 "
            "--repeats 1 --decode 2 --threads 1")
    rehearsal = subprocess.run(["bash", "bench/gpu_before_after.sh"], cwd=device, capture_output=True, text=True,
                               env={**env, "OUT": str(out), "GPU_BENCH_ARGS": args, "EACH_S": "240"}, timeout=600)
    assert rehearsal.returncode == 0, rehearsal.stdout + rehearsal.stderr
    for side in ("after", "before"):
        figures = json.loads((out / f"{side}.json").read_text())
        assert {"cpu_fixed_bs16", "cpu_line_second_order_bs16", "cpu_decode_kl_bs16"} <= set(figures), side
        assert f"=== {side}: exit 0" in (out / f"{side}.log").read_text()
    machine = (out / "machine.txt").read_text()  # (a committed tree: the after side is HEAD itself)
    assert f"after {git(checkout, 'rev-parse', 'HEAD').strip()}, before" in machine

    # restored: the index as committed, nothing of the kit left
    subprocess.run(["bash", "bench/gpu_kit.sh", "--restore"], cwd=checkout, env=env, check=True,
                   capture_output=True, timeout=60)
    assert git(checkout, "status", "--porcelain") == ""
    assert not (checkout / ".device").exists()
    assert "gpu_kit" not in (checkout / ".git/info/exclude").read_text()


def test_a_revision_that_is_no_commit_is_one_line_and_changes_nothing(checkout):
    kit = subprocess.run(["bash", "bench/gpu_kit.sh", "no-such-revision"], cwd=checkout, capture_output=True,
                         text=True, timeout=60)
    assert kit.returncode == 2 and kit.stderr.startswith("error: no-such-revision is no commit")
    assert kit.stderr.count("\n") == 1
    assert git(checkout, "status", "--porcelain") == "" and not (checkout / ".device").exists()
