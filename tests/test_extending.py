"""Adding an objective as README.md and docs/extending.md say: the page's example from user code,
run as written, and one shipped in a copy of the package that touches only the files they name."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import stabledrl.train as train_mod
from stabledrl.objectives import OBJECTIVES, ScoredBatch
from tests.conftest import make_tiny_policy, metric_rows

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
README = ROOT / "README.md"


def _example() -> str:
    """The Python block of the section "Adding your own objective"."""
    section = DOC.read_text().split("## Adding your own objective", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_the_documented_objective_trains_as_the_page_says(tmp_path, monkeypatch, objective_registry):
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
    exec(compile(_example(), str(DOC), "exec"), namespace)
    fn, section = OBJECTIVES["reinforce"], namespace["ReinforceConfig"](scale=0.5)
    assert runs[0].objective.name == "reinforce" and runs[0].objective.scale == 0.5
    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    # one call's diagnostics, logged: μ = 1, so ℓ_θ is ℓ_old rescored at θ_old: ρ = 1 and uniform weights (ESS = G)
    assert len(rows) == 2 and all(abs(r["ratio_max"] - 1) < 1e-4 and abs(r["ess"] - 4) < 1e-3 for r in rows), rows
    before, after = load_file(init / "model.safetensors"), load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert namespace["summary"]["skipped_steps"] == 0
    # The function by hand: A = (1, −1, 2, 0), ℓ = (−1, −2, −3, −4): −0.5 · (−1 + 2 − 6 + 0)/4 = 0.625
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    out = fn(section, ScoredBatch(logp, logp, torch.tensor([1.0, -1.0, 2.0, 0.0]), 2, torch.ones(4, 3)))
    assert out.loss.item() == pytest.approx(0.625, abs=1e-7)
    assert out.metrics["ratio_max"] == 1.0 and out.metrics["ess"] == 2.0  # ℓ = ℓ_old: ρ = 1, uniform weights
    # Named by a config once its module is imported (a config's section is picked by name)
    from stabledrl.config import load_config
    from stabledrl.settings import TrainConfig

    assert load_config(TrainConfig, {"objective": {"name": "reinforce", "scale": 0.5}}).objective == section


def test_the_readme_shows_the_same_objective_example():
    section = README.read_text().split("- **Objective**", 1)[1].split("- **Estimator**", 1)[0]
    blocks = re.findall(r"  ```python\n(.*?)  ```", section, re.S)
    assert len(blocks) == 1
    assert textwrap.dedent(blocks[0]) == _example()


# --- One shipped in the package: the edits the README's "To ship it" names, in a copy ---------------

_OPTIONS = '''

@dataclass
class VanillaPGConfig(ObjectiveSection):
    """Vanilla policy gradient: −mean_i A_i ℓ_θ(y_i), times `scale` (`stabledrl.objectives.vanilla_pg_loss`)."""

    name: Literal["vanilla_pg"] = "vanilla_pg"
    scale: float = 1.0
    """A factor on the loss."""

'''

_LOSS = '''

@objective("vanilla_pg")
def vanilla_pg_loss(opts: VanillaPGConfig, batch: ScoredBatch) -> LossOutput:
    """−scale · mean_i A_i ℓ_i: REINFORCE with the group mean as baseline."""
    loss = -opts.scale * (batch.advantages.detach() * batch.logp).mean()
    return LossOutput(loss, ratio_diagnostics(batch, clip_eps=opts.clip_eps))
'''

_TEST = '''

def test_vanilla_pg_by_hand():
    # A = (1, −1), ℓ = (−2, −4), scale 2: −2 · (−2 + 4)/2 = −2; ∂/∂ℓ = −2·A/2 = (−1, 1)
    logp = torch.tensor([-2.0, -4.0], requires_grad=True)
    out = vanilla_pg_loss(VanillaPGConfig(scale=2.0), ScoredBatch(logp, logp.detach(), torch.tensor([1.0, -1.0]), 2))
    assert out.loss.item() == -2.0
    out.loss.backward()
    assert logp.grad.tolist() == [-1.0, 1.0]
'''

_ROW = ("| vanilla policy gradient | `vanilla_pg` | `mc` | none | ✓ | not tested |\n")


def _files_the_readme_names() -> set[str]:
    """The files of the README's "To ship it" sentence: paths in code spans, and the README for its table."""
    sentence = README.read_text().split("To ship it", 1)[1].split("\n- **", 1)[0]
    paths = {p if (ROOT / p).exists() else f"src/{p}" for p in re.findall(r"`([\w/]+\.py)`", sentence)}
    return paths | ({"README.md"} if "methods table" in sentence else set())


def _in_copy(copy: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}  # before the editable install's path
    return subprocess.run([sys.executable, *argv], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


def test_an_objective_shipped_in_the_package_touches_only_the_files_the_readme_names(tmp_path):
    copy = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("src", "tests"):
        shutil.copytree(ROOT / d, copy / d, ignore=skip)
    for f in ("README.md", "pyproject.toml"):
        shutil.copy(ROOT / f, copy / f)
    named = _files_the_readme_names()
    assert named == {"src/stabledrl/objectives.py", "src/stabledrl/settings.py", "tests/test_objectives.py", "README.md"}

    def edit(rel: str, new: str) -> None:
        (copy / rel).write_text(new)

    settings = (copy / "src/stabledrl/settings.py").read_text()
    cut = settings.index("\nObjectiveConfig = ")  # beside the other sections, after them (the first is the default)
    edit("src/stabledrl/settings.py", settings[:cut] + _OPTIONS + settings[cut:])
    objectives = (copy / "src/stabledrl/objectives.py").read_text()
    objectives = objectives.replace("from stabledrl.settings import (", "from stabledrl.settings import (VanillaPGConfig, ")
    edit("src/stabledrl/objectives.py", objectives + _LOSS)
    tests = (copy / "tests/test_objectives.py").read_text()
    tests = tests.replace("from stabledrl.settings import ", "from stabledrl.settings import VanillaPGConfig, ")
    tests = tests.replace("from stabledrl.objectives import (", "from stabledrl.objectives import (vanilla_pg_loss, ")
    edit("tests/test_objectives.py", tests + _TEST)

    # Without torch: a config names it, the command line lists it, and the README's check fails
    # until the methods table has its row
    script = ("import sys; from stabledrl.config import load_config; from stabledrl.settings import TrainConfig\n"
              "cfg = load_config(TrainConfig, {'objective': {'name': 'vanilla_pg', 'scale': 2.0}})\n"
              "assert type(cfg.objective).__name__ == 'VanillaPGConfig' and cfg.objective.scale == 2.0\n"
              "from stabledrl.cli import build_parser; import contextlib, io\n"
              "out = io.StringIO()\n"
              "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit): build_parser().parse_args(['-h'])\n"
              "assert 'vanilla_pg' in out.getvalue(), out.getvalue()\n"
              "from tests.test_readme import test_methods_table_names_every_objective_and_estimator as check\n"
              "try:\n    check()\nexcept AssertionError as e:\n    print(e)\n"
              "assert 'torch' not in sys.modules\n")
    checked = _in_copy(copy, "-c", script)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "README does not name ['vanilla_pg']" in checked.stdout  # the check is not vacuous
    readme = (copy / "README.md").read_text()
    spg_row = next(line for line in readme.splitlines(keepends=True) if line.startswith("| SPG | `spg` |"))
    edit("README.md", readme.replace(spg_row, spg_row + _ROW))
    changed = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts
               and p.read_bytes() != (ROOT / p.relative_to(copy)).read_bytes()}
    assert changed == named

    # Then the README's check, the generic tests of every registered objective, its own test, the code's shape
    readme_check = "tests/test_readme.py::test_methods_table_names_every_objective_and_estimator"
    tests = _in_copy(copy, "-m", "pytest", "-v", "-p", "no:cacheprovider", readme_check, "tests/test_objectives.py",
                     "tests/test_code_shape.py",
                     "tests/test_train.py::test_every_objective_section_loads_by_name_and_has_a_loss")
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert "test_every_objective_splits_into_its_groups_as_its_normaliser_declares[vanilla_pg] PASSED" in tests.stdout
    assert "test_vanilla_pg_by_hand PASSED" in tests.stdout
