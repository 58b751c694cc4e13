"""The real-model recipes (configs/<family>-...yaml, docs/recipes.md): each parses into
`TrainConfig`, holds the published settings it claims, names its launch command and data
command, and its task builds from a local file in the layout the export command writes."""

import json
from pathlib import Path

import pytest

from stabledrl.config import load_config
from stabledrl.tasks import get_task
from stabledrl.train import TrainConfig

ROOT = Path(__file__).parents[1]
RECIPES = ["llada-8b-instruct-gsm8k-stabledrl", "llada-8b-instruct-math-stabledrl", "dream-7b-instruct-gsm8k-stabledrl",
           "sdar-8b-chat-gsm8k-stabledrl", "llada-8b-instruct-gsm8k-d1-diffu-grpo"]
MODELS = {"llada": "GSAI-ML/LLaDA-8B-Instruct", "dream": "Dream-org/Dream-v0-Instruct-7B", "sdar": "JetLM/SDAR-8B-Chat"}


def load(name):
    return load_config(TrainConfig, ROOT / "configs" / f"{name}.yaml")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_and_names_its_commands(name):
    cfg = load(name)
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    assert "accelerate launch --config_file configs/accelerate/fsdp.yaml -m stabledrl train" in text
    assert f"--config configs/{name}.yaml" in text
    task = cfg.task.name
    assert f"python -m stabledrl.tasks.datasets export {task} --out data/{task}" in text
    assert cfg.task.options["path"] == f"data/{task}/{{split}}.jsonl"  # what the export writes
    assert cfg.model.path == MODELS[name.split("-")[0]]
    assert name in (ROOT / "docs" / "recipes.md").read_text()
    assert (cfg.mixed_precision, cfg.rollout.noise) == ("bf16", "counter")
    if name.startswith("sdar"):  # SDAR's own settings (below)
        return
    # the LLaDA authors' and d1's shared settings: 256 tokens at temperature 0.9, clip 0.2, wd 0.1
    assert (cfg.rollout.gen_length, cfg.rollout.temperature) == (256, 0.9)
    assert (cfg.grad_clip, cfg.weight_decay) == (0.2, 0.1)


@pytest.mark.parametrize("name", [n for n in RECIPES if n.endswith("-stabledrl") and not n.startswith("sdar")])
def test_stabledrl_recipes_hold_the_authors_settings(name):
    cfg = load(name)
    # the authors' step: 32 prompts in 4 accumulation rounds (1 prompt per GPU x 8 GPUs each); their
    # 2,000 optimizer steps are 1,000 of ours at mu = 2
    assert (cfg.group_size, cfg.mu, cfg.prompts_per_step, cfg.accumulation_rounds) == (16, 2, 32, 4)
    assert (cfg.lr, cfg.seed, cfg.steps * cfg.mu) == (2e-6, 113, 2000)
    assert (cfg.objective.name, cfg.objective.clip, cfg.objective.clip_max) == ("stabledrl", "upper", 5.0)
    assert cfg.task.options["convention"] == "stabledrl" and cfg.model.gradient_checkpointing
    assert (cfg.objective.likelihood, cfg.objective.spg_beta, cfg.objective.spg_omega) == ("spg", 1.5, 0.5)
    assert (cfg.estimator.method, cfg.estimator.num_samples) == ("block_random", 2)
    assert cfg.estimator.options == {"block_length": 32, "p_prompt": 0.15}
    assert (cfg.rollout.steps, cfg.rollout.block_length, cfg.rollout.micro_batch) == (128, 32, 16)


def test_the_sdar_recipe_holds_sdars_own_rl_settings():
    # Gen-Verse/dLLM-RL configs/rl_sdar.yaml (TraDo): 64 prompts x 16 at temperature 1.0, 2,000 tokens
    # in blocks of 4 with 4 steps a block and the dynamic threshold 0.9, prompts cut to 784 tokens,
    # AdamW lr 1e-6 constant, no weight decay, gradient norm 1.0, seed 10086, 80 steps, every 10
    cfg = load("sdar-8b-chat-gsm8k-stabledrl")
    r = cfg.rollout
    assert (r.temperature, r.gen_length, r.steps, r.threshold, r.max_prompt_length) == (1.0, 2000, 2000, 0.9, 784)
    assert (cfg.prompts_per_step, cfg.group_size, cfg.mu) == (64, 16, 1)
    assert (cfg.lr, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip, cfg.seed) == (1e-6, 1.0, 0.0, 1.0, 10086)
    assert (cfg.steps, cfg.eval_every, cfg.save_every) == (80, 10, 10)
    # not theirs: StableDRL on the blockwise ELBO (a block model: the staircase, blocks from its config)
    assert (cfg.objective.name, cfg.estimator.method, cfg.model.adapter) == ("stabledrl", "blockwise", "sdar")
    assert cfg.model.block_size is None and cfg.task.options["completion_length"] == 2000


def test_d1_recipe_holds_d1s_settings():
    cfg = load("llada-8b-instruct-gsm8k-d1-diffu-grpo")
    # 16 prompts: 6 rows per GPU x 8 GPUs x 2 accumulation rounds / G
    assert (cfg.group_size, cfg.mu, cfg.prompts_per_step, cfg.accumulation_rounds, cfg.lr) == (6, 12, 16, 2, 3e-6)
    o = cfg.objective
    assert (o.name, o.clip_eps, o.ratio_level, o.token_aggregation, o.beta, o.advantage_scale) == (
        "grpo", 0.5, "token", "batch_token_mean", 0.04, "none")
    assert (cfg.estimator.method, cfg.estimator.options) == ("mean_field", {"p_prompt": 0.15})
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (128, 64, 0.05)
    assert cfg.task.options["convention"] == "d1"
    assert (cfg.rollout.max_prompt_length, cfg.eval_sampling.max_prompt_length) == (200, None)  # training only


def test_the_math_recipe_filters_training_problems_as_the_authors():
    options = load("llada-8b-instruct-math-stabledrl").task.options
    assert (options["max_level"], options["max_problem_chars"], options["max_problem_words"]) == (4, 1500, 300)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_task_builds_from_a_local_file(tmp_path, name):
    cfg = load(name)
    rows = {"gsm8k": {"question": "2+2?", "answer": "2+2=4\n#### 4"},
            "math": {"problem": "2+2?", "solution": "It is $\\boxed{4}$."}}[cfg.task.name]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(rows) + "\n")
    options = {**cfg.task.options, "path": str(tmp_path / "{split}.jsonl"), "cache_dir": str(tmp_path / "hf")}
    task = get_task(cfg.task.name, **options)
    problem = task.generate(1, split="test")[0]
    assert problem.prompt.startswith("2+2?") or problem.prompt.endswith("2+2?")
    getattr(task, "close", lambda: None)()


def test_the_memory_table_predicts_the_recipes_as_shipped():
    # benchmarks/scale.py's recipes (the README's memory table) read the configs themselves
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    pred = scale.predict_recipes(80e9)
    for name in scale.RECIPES:
        cfg = load(name)
        b = pred[name]["batch"]
        assert (b["prompts_per_step"], b["group_size"], b["accumulation_rounds"], b["gen_length"]) == \
            (cfg.prompts_per_step, cfg.group_size, cfg.accumulation_rounds, cfg.rollout.gen_length), name
        assert pred[name]["footprint"]["checkpointing"] == cfg.model.gradient_checkpointing
