"""docs/extending.md's example objective, run as the page writes it."""

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import stabledrl.train as train_mod
from stabledrl.objectives import OBJECTIVES, ScoredBatch
from tests.conftest import make_tiny_policy, metric_rows

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
README = DOC.parents[1] / "README.md"


def _example() -> str:
    """The Python block of the section "Adding your own objective"."""
    section = DOC.read_text().split("## Adding your own objective", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_the_documented_objective_trains_as_the_page_says(tmp_path, monkeypatch):
    init = tmp_path / "init"
    make_tiny_policy(seed=41).save(init)
    real_train = train_mod.train
    runs = []

    def small(cfg, **kw):  # the page's call, on a tiny model for two short steps
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(init)),
                                  output_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=4,
                                  lr=1e-3, eval_n=4, save_every=2, zero_variance_groups="keep",
                                  task=dataclasses.replace(cfg.task, name="sudoku"))
        runs.append(cfg)
        return real_train(cfg, progress=False, **kw)

    monkeypatch.setattr(train_mod, "train", small)
    namespace: dict = {}
    try:
        exec(compile(_example(), str(DOC), "exec"), namespace)
        fn, section = OBJECTIVES["reinforce"], namespace["ReinforceConfig"](scale=0.5)
    finally:
        OBJECTIVES.pop("reinforce", None)
    assert runs[0].objective.name == "reinforce" and runs[0].objective.scale == 0.5
    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all("logp_mean" in r for r in rows)
    before, after = load_file(init / "model.safetensors"), load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert namespace["summary"]["skipped_steps"] == 0
    # The function by hand: A = (1, −1, 2, 0), ℓ = (−1, −2, −3, −4): −0.5 · (−1 + 2 − 6 + 0)/4 = 0.625
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    out = fn(section, ScoredBatch(logp, logp, torch.tensor([1.0, -1.0, 2.0, 0.0]), 2, torch.ones(4, 3)))
    assert out.loss.item() == pytest.approx(0.625, abs=1e-7)
    assert out.metrics["logp_mean"] == pytest.approx(-2.5, abs=1e-7)


def test_the_readme_shows_the_same_objective_example():
    section = README.read_text().split("- **Objective**", 1)[1].split("- **Estimator**", 1)[0]
    blocks = re.findall(r"  ```python\n(.*?)  ```", section, re.S)
    assert len(blocks) == 1
    assert textwrap.dedent(blocks[0]) == _example()
