"""The `stabledrl` lm-eval model on the shipped tiny model and a local Countdown task: the
same completions and accuracy as `stabledrl.evaluate` on the same problems and decoding,
in process and through lm-eval's command line (offline: the task reads a local JSONL)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm-eval is not installed (pip install 'stabledrl[lm-eval]')")

MODEL = Path(__file__).resolve().parents[1] / "checkpoints" / "countdown-tiny"
N = 16

TASK_YAML = """\
task: countdown_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<never>"]
process_results: !function utils.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

UTILS = f"""\
from stabledrl.tasks import get_task
from stabledrl.tasks.base import score_all

TASK = get_task("countdown")
PROBLEMS = TASK.generate({N}, split="test", seed=0)


def process_results(doc, results):
    return {{"acc": float(score_all(TASK, [results[0]], [PROBLEMS[doc["index"]]])[0].correct)}}
"""


@pytest.fixture(scope="module")
def problems():
    from stabledrl.tasks import get_task

    task = get_task("countdown")
    return task, task.generate(N, split="test", seed=0)


@pytest.fixture()
def task_dir(tmp_path, problems, monkeypatch):
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    _, probs = problems
    data = tmp_path / "countdown.jsonl"
    data.write_text("".join(json.dumps({"index": i, "prompt": p.prompt, "target": p.answer}) + "\n"
                            for i, p in enumerate(probs)))
    (tmp_path / "countdown_local.yaml").write_text(TASK_YAML.format(data=data))
    (tmp_path / "utils.py").write_text(UTILS)
    return tmp_path


def _reference(problems, **sampling):
    from stabledrl.evaluate import evaluate
    from stabledrl.models import load_policy
    from stabledrl.settings import SamplingConfig

    task, probs = problems
    return evaluate(load_policy(str(MODEL)), task, probs, SamplingConfig(**sampling), seed=3, progress=False)


def test_same_completions_and_accuracy_as_stabledrl_eval_sampled(task_dir, problems):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import stabledrl.lm_eval_model  # noqa: F401  (registers the model)

    task, _ = problems
    sampling = {"gen_length": task.completion_length, "steps": task.completion_length // 2, "temperature": 1.0}
    ref = _reference(problems, **sampling)
    args = ",".join(f"{k}={v}" for k, v in {"pretrained": MODEL, "device": "cpu", "seed": 3, **sampling}.items())
    out = lm_eval.simple_evaluate(model="stabledrl", model_args=args, tasks=["countdown_local"],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    got = sorted(out["samples"]["countdown_local"], key=lambda s: s["doc"]["index"])
    assert [s["resps"][0][0] for s in got] == [s["completion"] for s in ref.samples]
    assert 0 < ref.accuracy < 1  # the comparison can tell right from wrong completions
    assert out["results"]["countdown_local"]["acc,none"] == ref.accuracy


def test_lm_eval_command_line_gives_stabledrl_eval_accuracy(task_dir, problems, tmp_path):
    task, _ = problems
    ref = _reference(problems, gen_length=task.completion_length)  # greedy: the default decoding
    assert 0 < ref.accuracy < 1  # the comparison can tell right from wrong completions
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "stabledrl.lm_eval_model", "--model", "stabledrl", "--model_args",
           f"pretrained={MODEL},device=cpu,seed=3,gen_length={task.completion_length}", "--tasks", "countdown_local",
           "--include_path", str(task_dir), "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(result.read_text())["results"]["countdown_local"]["acc,none"]
    assert acc == ref.accuracy


def test_loglikelihood_needs_an_estimator_and_rolling_is_refused(problems):
    from lm_eval.api.instance import Instance

    from stabledrl.lm_eval_model import StableDRLLM, cut_at

    assert cut_at("12+3\n\nQ: next", ["\n\n", "Q:"]) == "12+3" and cut_at("abc", []) == "abc"
    lm = StableDRLLM(pretrained=str(MODEL), device="cpu")
    req = Instance(request_type="loglikelihood", doc={}, arguments=("3,5,7=22", "3*5+7"), idx=0)
    with pytest.raises(NotImplementedError, match="estimator=mc"):
        lm.loglikelihood([req])
    with pytest.raises(NotImplementedError, match="rolling"):
        lm.loglikelihood_rolling([req])
    with pytest.raises(ValueError, match="unknown key 'gen_len'"):
        StableDRLLM(pretrained=str(MODEL), gen_len=3)


def test_loglikelihood_is_the_chosen_estimator(problems):
    import torch
    from lm_eval.api.instance import Instance

    from stabledrl.data import encode_policy_prompts
    from stabledrl.likelihood import Completions, estimate
    from stabledrl.lm_eval_model import StableDRLLM

    lm = StableDRLLM(pretrained=str(MODEL), device="cpu", estimator="exact")
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(c, y), idx=0)
            for c, y in [("3,5,7=22", "3*5+7"), ("2,4,9=17", "9+2*4")]]
    got = lm.loglikelihood(reqs)
    for (c, y), (ll, greedy) in zip([r.args for r in reqs], got):
        ids, mask = encode_policy_prompts(lm.policy, [c])
        comp = torch.tensor([lm.policy.tokenizer.encode(y, add_special_tokens=False)])
        with torch.no_grad():
            rows = Completions(torch.ones_like(comp, dtype=torch.bool), prompt_ids=ids, completion_ids=comp,
                               prompt_mask=mask)
            want = estimate(lm.policy, rows, method="exact").sequence[0]  # the ELBO by enumeration: no randomness
        assert ll == float(want) and ll < 0 and greedy is False


def test_batch_size_is_read_as_lm_eval_passes_it():
    from stabledrl.lm_eval_model import DEFAULT_ROWS_PER_CALL, StableDRLLM, rows_per_call

    # lm-eval's command line passes --batch_size as text; model_args' digits arrive as ints
    assert rows_per_call("8") == rows_per_call(8) == rows_per_call(" 8 ") == 8
    # "auto" / "auto:N": no search here; lm-eval's bound on its search (max_batch_size), else the default
    assert rows_per_call("auto") == rows_per_call("auto:4") == rows_per_call(None) == DEFAULT_ROWS_PER_CALL == 16
    assert rows_per_call("auto:2.5", 32) == rows_per_call("auto", "32") == 32
    for bad in ("0", -2, "eight", "auto:x", "auto:0", "autox", "8.5"):
        with pytest.raises(ValueError, match="batch_size must be a positive integer, 'auto' or 'auto:N'"):
            rows_per_call(bad)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer, got 'many'"):
        rows_per_call("auto", "many")
    # as lm-eval makes the model: model_args over its own flags (--batch_size 8 arrives as "8")
    flags = {"batch_size": "8", "max_batch_size": None, "device": None}
    assert StableDRLLM.create_from_arg_string(f"pretrained={MODEL},device=cpu", flags).batch_size == 8
    lm = StableDRLLM.create_from_arg_string(f"pretrained={MODEL},device=cpu,batch_size=auto:2,max_batch_size=4", flags)
    assert lm.batch_size == 4
