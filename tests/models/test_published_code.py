"""The tests of the published LLaDA, Dream and SDAR files (`remote_code` in
tests/models/test_adapters.py), which skip under transformers 5 where stabledrl refuses those
files, run here in a virtual environment of transformers 4.57 that the test makes (slow: it
installs; the package index and this torch's wheel must be reachable, as they are for CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/models/test_adapters.py", "tests/models/test_native.py", "tests/models/test_real_layouts.py"]


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{cmd[:4]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="under transformers 4.x the fast layer runs the published files' tests itself")
def test_the_published_files_tests_pass_under_transformers_4_57(tmp_path):
    venv = tmp_path / "v4"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"])
    _run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]", "transformers==4.57.6", "huggingface_hub<1.0"])
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, "-rs"], cwd=ROOT)
    tail = out.stdout.strip().splitlines()[-1]
    assert " passed" in tail and "skipped" not in tail and "failed" not in tail, tail  # the remote_code tests ran
