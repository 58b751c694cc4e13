"""The test suites under the lowest versions pyproject.toml admits (docs/scale-out.md, "Lowest
versions"): a fresh virtual environment in a temporary folder with torch 2.13.0 (the CPU build on
our machines) and each library whose API stabledrl calls at its lower bound, this checkout installed
in it (editable), then the README's two pytest runs (fast, then -m slow). Writes the versions
installed and each run's summary line and exit status.

    python benchmarks/lab/lowest_versions.py --out benchmarks/results/lowest_versions.json

`--pin name==version` (repeated) adds or replaces a pin, to bisect a bound. Takes about 10 minutes
on 2 cores, most of it the slow suite.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# pyproject's lower bounds, as installable releases; tqdm, tokenizers, packaging and pyyaml float (the
# others' own bounds decide them). pyarrow is no dependency of ours, but the newest one pip gives
# datasets (26) refuses NumPy 1 at import; 19.0.1 takes it.
PINS = {"torch": "2.13.0", "transformers": "4.56.0", "peft": "0.16.0", "accelerate": "1.13.0",
        "huggingface_hub": "0.34.0", "safetensors": "0.4.3", "numpy": "1.24.4", "dacite": "1.8.0",
        "matplotlib": "3.8.0", "tensorboard": "2.14.0", "datasets": "3.0.2", "math-verify": "0.8.0",
        "pyarrow": "19.0.1"}


def _canonical(name: str) -> str:
    """A distribution's name as pip compares them (huggingface_hub is huggingface-hub)."""
    return name.lower().replace("_", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pin", action="append", default=[], help="name==version, over the built-in pins")
    args = ap.parse_args()
    pins = dict(PINS, **dict(p.split("==") for p in args.pin))
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "venv"
        venv.create(env, with_pip=True)
        py = str(env / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={pins['torch']}"], check=True)
        subprocess.run([*pip, "-e", f"{REPO}[test]", *(f"{n}=={v}" for n, v in pins.items())], check=True)
        listed = json.loads(subprocess.run([py, "-m", "pip", "list", "--format", "json"], check=True,
                                           capture_output=True, text=True).stdout)
        versions = {_canonical(p["name"]): p["version"] for p in listed}
        runs = {}
        for name, extra in (("fast", []), ("slow", ["-m", "slow"])):
            proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra], cwd=REPO,
                                  capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            runs[name] = {"exit": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:],
                          "failed": [line for line in lines if line.startswith(("FAILED", "ERROR"))]}
            print(name, runs[name]["summary"], flush=True)
    result = {"pins": pins, "installed": {n: versions.get(_canonical(n)) for n in pins}, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(max(r["exit"] for r in runs.values()))


if __name__ == "__main__":
    main()
