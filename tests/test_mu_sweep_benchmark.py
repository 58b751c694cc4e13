"""benchmarks/mu_sweep.py compares objectives and μ at an equal number of rollouts: its configs
must differ only where the sweep says they do."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mu_sweep import OBJECTIVES, cells, config, curves_table, markdown_table, mean_or_none, short_float  # noqa: E402

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


def run_result(name, mu, seed, final, validation, ess, spikes, collapse):
    return {"objective": name, "mu": mu, "seed": seed, "test_initial": 0.329, "test_final": final,
            "eval_final": {"accuracy": validation}, "log_ratio_std_mean": 3.7, "bypass_fraction_mean": 0.25,
            "ess_mean": ess, "clip_fraction_mean": 0.9, "spikes": spikes, "collapse": collapse}


def test_the_markdown_table_is_the_docs_table_of_the_results():
    results = [run_result("grpo", 1, 1, 0.300, 0.33, None, 4, ["spike"]),  # out of seed order on purpose
               run_result("grpo", 1, 0, 0.310, 0.35, None, 7, []),
               run_result("stabledrl", 2, 0, 0.364, 0.42, 4.0, 0, []),
               run_result("stabledrl", 2, 1, 0.344, 0.40, 4.2, 0, [])]
    table = markdown_table(results, sweep_args("countdown", objectives=["grpo", "stabledrl"], mus=[1, 2], seeds=[0, 1]))
    # by hand: GRPO's mean (31.0 + 30.0) / 2 = 30.5 is 2.4 points below 32.9; StableDRL's (36.4 + 34.4) / 2 = 35.4,
    # 2.5 above; the validation means are 34.0% and 41.0%; ESS 4.1; cells without runs have no row
    assert table.splitlines()[2:] == [
        "| GRPO | 1 | 32.9% → 31.0 / 30.0% | \N{MINUS SIGN}2.4 | 34.0% | 3.7 | 0.25 | — | 0.9 | 7 / 4 | 1 of 2 |",
        "| StableDRL | 2 | 32.9% → 36.4 / 34.4% | +2.5 | 41.0% | 3.7 | 0.25 | 4.1 | 0.9 | 0 / 0 | 0 of 2 |",
    ]
    assert "(seeds 0 / 1)" in table.splitlines()[0]


def test_the_curves_table_reads_masks_and_lr_from_each_runs_config(monkeypatch):
    monkeypatch.chdir(ROOT)
    run = {**run_result("stabledrl", 2, 0, 0.379, 0.448, 4.0, 0, []), "entropy_last_5": 0.2875,
           "accuracy_curve": [[0, 0.408], [10, 0.418], [20, 0.448]]}
    args = sweep_args("countdown", objectives=["stabledrl"], mus=[2], seeds=[0], set=["lr=2.5e-5"])
    lines = curves_table([run], args).splitlines()
    assert "from 32.9%" in lines[0] and "validation at steps 0 / 10 / 20" in lines[0]
    assert lines[2] == "| StableDRL | independent | 2.5e-5 | 2 | 0 | 37.9% | 40.8 / 41.8 / 44.8 | 0.29 | 3.7 |"
    shared = curves_table([{**run, "log_ratio_std_mean": 0.0}], sweep_args(
        "countdown", objectives=["stabledrl"], mus=[2], seeds=[0], set=["masks=shared"])).splitlines()[2]
    assert shared.startswith("| StableDRL | shared | 5e-5 | 2 |") and shared.endswith("| 0.29 | 0 |")


def test_short_float_writes_a_learning_rate_as_the_docs_do():
    assert [short_float(x) for x in (5e-5, 2.5e-5, 1e-4, 2e-4, 1e-6)] == ["5e-5", "2.5e-5", "1e-4", "2e-4", "1e-6"]
