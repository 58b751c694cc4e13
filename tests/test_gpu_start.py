"""benchmarks/gpu_start.py on CPU: the launch it makes on a GPU (accelerate, the FSDP config, a
stand-in of a real checkpoint, 2 steps) runs here too and reports what it saw."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # an accelerate launch (about 10 s): .ci/run's second step
def test_the_launch_trains_a_stand_in_and_reports_it(tmp_path):
    out = tmp_path / "start.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_start.py"), "--models", "llada", "--no-main",
                          "--mixed-precision", "no", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = json.loads(out.read_text())["stand_ins"]
    assert run["rc"] == 0 and run["model"] == "llada"
    # without a GPU the trainer's Accelerator(cpu=True) makes the FSDP launch a CPU process group
    # (docs/scale-out.md, "FSDP on CPU"); on a GPU it is FSDP, with the stand-in's block wrapped
    if torch.cuda.is_available():
        assert run["distributed_type"] == "DistributedType.FSDP" and "FSDPLLaDALlamaBlock" in run["fsdp_wrapped"]
    else:
        assert run["distributed_type"] == "DistributedType.MULTI_CPU" and run["fsdp_wrapped"] == []
    assert len(run["losses"]) == 2 and run["losses_finite"] and run["weights_moved"]
