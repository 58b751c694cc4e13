"""benchmarks/mu_sweep.py compares objectives and μ at an equal number of rollouts: its configs
must differ only where the sweep says they do."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mu_sweep import OBJECTIVES, cells, config, mean_or_none  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def sweep_args(preset: str, **kw) -> argparse.Namespace:
    args = dict(preset=preset, objectives=OBJECTIVES, mus=[1, 2, 4], seeds=[0, 1, 2], steps=40, rollouts=128,
                eval_every=10, eval_n=500, eval_split="validation", set=[], tag="t", runs_dir="runs/mu_sweep")
    return argparse.Namespace(**{**args, **kw})


@pytest.mark.parametrize("preset", ["countdown", "sudoku"])
def test_every_cell_draws_the_same_rollouts_with_independent_masks(preset, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = sweep_args(preset)
    todo = cells(args)
    assert len(todo) == 4 * 3 * 3 and len(set(todo)) == len(todo)
    for seed, name, mu in todo:
        cfg = config(args, seed, name, mu)
        assert cfg.prompts_per_step * cfg.group_size == 128  # 16 x 8 for the mc presets, 8 x 16 for SPG's
        assert (cfg.steps, cfg.mu, cfg.seed, cfg.masks) == (40, mu, seed, "independent")
        assert cfg.eval_split == "validation" and cfg.eval_every == 10
        assert cfg.output_dir.endswith(f"{name}-mu{mu}-seed{seed}")
    # two shards split the cells between them, each once
    assert sorted(todo[0::2] + todo[1::2]) == sorted(todo)


def test_a_rollout_count_that_a_group_does_not_divide_is_refused(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="not a multiple of"):
        config(sweep_args("countdown", rollouts=100), 0, "spg", 1)  # groups of 16


def test_mean_or_none_skips_objectives_that_log_no_value():
    assert mean_or_none([1.0, None, 3.0]) == 2.0
    assert mean_or_none([None, None]) is None
