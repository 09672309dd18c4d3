"""The device scripts' plans (``DRY_RUN=1``: the commands printed, nothing run), on the host:
``tools/device_stages.sh`` deals its lanes of stages over the GPUs that ``nvidia-smi -L`` lists
(a stand-in lists two here), lane 0 with the tests of no stage unless told otherwise, and refuses
a call without lanes."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def plan(tmp_path, gpus: int, **env) -> list:
    """(GPU, --tests, [stages]) of each command the script would run, with ``gpus`` GPUs listed."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus)))
    smi.chmod(0o755)
    run_env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "DRY_RUN": "1", **env}
    res = subprocess.run(["bash", str(ROOT / "tools/device_stages.sh")], env=run_env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = []
    for line in res.stdout.splitlines():
        m = re.match(r"GPU (\d+): timeout \d+ python3 -m tools.gpu_report .*--tests (\S+) (.*)", line)
        if m:
            out.append((int(m[1]), m[2], re.findall(r"--stage (\S+)", m[3])))
    return sorted(out)


def test_device_stages_deals_lanes_over_the_gpus(tmp_path):
    assert plan(tmp_path, 2, DEVICE_STAGE_LANES="f a b;e") == [(0, "stage", ["f", "a", "b"]),
                                                               (1, "stage-only", ["e"])]
    assert plan(tmp_path, 2, DEVICE_STAGE_LANES="d1 c;d2 d3 d4 d5", DEVICE_STAGE_NONE="0") == [
        (0, "stage-only", ["d1", "c"]), (1, "stage-only", ["d2", "d3", "d4", "d5"])]
    # one GPU: the lanes in turn on it; three lanes on two GPUs: the third after the first
    assert plan(tmp_path, 1, DEVICE_STAGE_LANES="f;e") == [(0, "stage", ["f"]), (0, "stage-only", ["e"])]
    assert [g for g, _, _ in plan(tmp_path, 2, DEVICE_STAGE_LANES="a;b;c")] == [0, 0, 1]


def test_device_stages_needs_its_lanes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DEVICE_STAGE_LANES"}
    res = subprocess.run(["bash", str(ROOT / "tools/device_stages.sh")], env={**env, "OUT": str(tmp_path)},
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "DEVICE_STAGE_LANES" in res.stderr


@pytest.mark.parametrize("script", ["device_stages.sh", "device_tests.sh", "device_bench.sh"])
def test_device_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / script)], timeout=60).returncode == 0
