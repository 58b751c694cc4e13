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


# ------------------------------------------------------------------------------ every setting pinned
# Each recipe's YAML, flattened, against a table of (value, source): AUTHORS (their config), a phrase
# of docs/recipes.md that lists the deviation, or OURS with the reason ("Settings that are ours").
# A setting added or changed in a YAML without its row here fails, so none drifts in unlisted.
AUTHORS = "authors"


def ours(reason: str) -> tuple[str, str]:
    return ("ours", reason)


def listed(phrase: str) -> tuple[str, str]:
    return ("listed", phrase)


LLADA = {
    "model.path": ("GSAI-ML/LLaDA-8B-Instruct", AUTHORS), "model.adapter": ("llada", ours("native code")),
    "model.mask_token_id": (126336, AUTHORS), "model.dtype": ("float32", listed("Weights in float32, compute in bf16")),
    "model.gradient_checkpointing": (True, AUTHORS), "model.chat_template": (True, AUTHORS),
    "model.stop_tokens": (["<|eot_id|>"], AUTHORS), "output_dir": ("runs/llada-8b-instruct-gsm8k-stabledrl", ours("path")),
    "task.name": ("gsm8k", AUTHORS), "task.options.path": ("data/gsm8k/{split}.jsonl", ours("path")),
    "task.options.convention": ("stabledrl", AUTHORS), "task.options.completion_length": (256, AUTHORS),
    "objective.name": ("stabledrl", AUTHORS), "objective.clip": ("upper", AUTHORS), "objective.clip_max": (5.0, AUTHORS),
    "objective.likelihood": ("spg", AUTHORS), "objective.spg_beta": (1.5, AUTHORS), "objective.spg_omega": (0.5, AUTHORS),
    "estimator.method": ("block_random", AUTHORS), "estimator.num_samples": (2, AUTHORS),
    "estimator.options.block_length": (32, AUTHORS), "estimator.options.p_prompt": (0.15, AUTHORS),
    "estimator.reduction": ("sum", AUTHORS),
    "rollout.gen_length": (256, AUTHORS), "rollout.steps": (128, AUTHORS), "rollout.block_length": (32, AUTHORS),
    "rollout.temperature": (0.9, AUTHORS), "rollout.micro_batch": (16, listed("16 rows a call: a prompt's")),
    "rollout.sort_by_length": (True, ours("less padding")), "rollout.noise": ("counter", ours("device-side noise")),
    "eval_sampling.gen_length": (256, AUTHORS), "eval_sampling.steps": (128, AUTHORS),
    "eval_sampling.block_length": (32, AUTHORS), "eval_sampling.temperature": (0.0, AUTHORS),
    "eval_sampling.noise": ("counter", ours("device-side noise")), "eval_sampling.micro_batch": (64, ours("memory")),
    "masks": ("independent", AUTHORS), "zero_variance_groups": ("skip", listed("Groups whose rewards all tie")),
    "seed": (113, AUTHORS), "steps": (1000, listed("1,000 of ours, each μ = 2 optimizer steps")),
    "prompts_per_step": (32, AUTHORS), "accumulation_rounds": (4, AUTHORS), "group_size": (16, AUTHORS), "mu": (2, AUTHORS),
    "optimizer": ("adamw", AUTHORS), "lr": (2e-6, AUTHORS), "min_lr_ratio": (0.0, listed("cosine to 0 over the run")),
    "weight_decay": (0.1, AUTHORS), "grad_clip": (0.2, AUTHORS), "mixed_precision": ("bf16", AUTHORS),
    "drift_kl": (False, ours("no reference copy")), "eval_every": (50, listed("Evaluation every 50 steps")),
    "eval_n": (1319, AUTHORS), "eval_split": ("test", AUTHORS), "save_every": (25, listed("checkpoints every 25")),
}
MATH = {**LLADA, "output_dir": ("runs/llada-8b-instruct-math-stabledrl", ours("path")), "task.name": ("math", AUTHORS),
        "task.options.path": ("data/math/{split}.jsonl", ours("path")), "task.options.verify_timeout_s": (5, AUTHORS),
        "task.options.timeout_s": (20, AUTHORS), "task.options.max_level": (4, AUTHORS),
        "task.options.max_problem_chars": (1500, AUTHORS), "task.options.max_problem_words": (300, AUTHORS),
        "eval_n": (500, listed("MATH-500"))}
DREAM = {**LLADA, "model.path": ("Dream-org/Dream-v0-Instruct-7B", listed("Dream** is not in their paper")),
         "model.adapter": ("dream", ours("native code")), "model.mask_token_id": (151666, AUTHORS),
         "model.stop_tokens": (["<|im_end|>"], AUTHORS), "output_dir": ("runs/dream-7b-instruct-gsm8k-stabledrl", ours("path")),
         "eval_sampling.steps": (256, listed("greedily in one block of 256, one slot a step"))}
del DREAM["eval_sampling.block_length"]
SDAR = {
    "model.path": ("JetLM/SDAR-8B-Chat", AUTHORS), "model.adapter": ("sdar", ours("native code")),
    "model.mask_token_id": (151669, AUTHORS), "model.dtype": ("float32", listed("Weights in float32, compute in bf16")),
    "model.gradient_checkpointing": (True, AUTHORS), "model.chat_template": (True, AUTHORS),
    "model.stop_tokens": (["<|im_end|>"], AUTHORS), "output_dir": ("runs/sdar-8b-chat-gsm8k-stabledrl", ours("path")),
    "task.name": ("gsm8k", listed("their runs train on MATH's train split")),
    "task.options.path": ("data/gsm8k/{split}.jsonl", ours("path")),
    "task.options.convention": ("stabledrl", listed("the recipe is the library's method on SDAR")),
    "task.options.completion_length": (2000, AUTHORS),
    "objective.name": ("stabledrl", listed("the recipe is the library's method on SDAR")), "objective.clip": ("upper", AUTHORS),
    "objective.clip_max": (5.0, AUTHORS), "objective.ratio_level": ("sequence", AUTHORS),
    "estimator.method": ("blockwise", listed("on the blockwise ELBO")), "estimator.num_samples": (2, AUTHORS),
    "estimator.options.inner": ("mc", AUTHORS),
    "rollout.gen_length": (2000, AUTHORS), "rollout.steps": (2000, AUTHORS), "rollout.threshold": (0.9, AUTHORS),
    "rollout.temperature": (1.0, AUTHORS), "rollout.max_prompt_length": (784, AUTHORS),
    "rollout.micro_batch": (16, ours("memory")), "rollout.sort_by_length": (True, ours("less padding")),
    "rollout.noise": ("counter", ours("device-side noise")),
    "eval_sampling.gen_length": (2000, AUTHORS), "eval_sampling.steps": (2000, AUTHORS),
    "eval_sampling.threshold": (0.9, AUTHORS), "eval_sampling.temperature": (0.0, listed("evaluation greedy")),
    "eval_sampling.noise": ("counter", ours("device-side noise")), "eval_sampling.micro_batch": (64, ours("memory")),
    "masks": ("independent", AUTHORS), "zero_variance_groups": ("skip", listed("Groups whose rewards all tie")),
    "seed": (10086, AUTHORS), "steps": (80, AUTHORS), "prompts_per_step": (64, AUTHORS),
    "accumulation_rounds": (64, listed("accumulates the step's 64 groups in 64 rounds")), "group_size": (16, AUTHORS),
    "mu": (1, listed("into one optimizer step, μ = 1")), "optimizer": ("adamw", AUTHORS), "lr": (1e-6, AUTHORS),
    "min_lr_ratio": (1.0, AUTHORS), "weight_decay": (0.0, AUTHORS), "grad_clip": (1.0, AUTHORS),
    "mixed_precision": ("bf16", AUTHORS), "drift_kl": (False, ours("no reference copy")), "eval_every": (10, AUTHORS),
    "eval_n": (1319, listed("on the whole test split")), "eval_split": ("test", AUTHORS), "save_every": (10, AUTHORS),
}
D1 = {
    "model.path": ("GSAI-ML/LLaDA-8B-Instruct", AUTHORS), "model.adapter": ("llada", ours("native code")),
    "model.mask_token_id": (126336, AUTHORS), "model.dtype": ("bfloat16", listed("4-bit (nf4) base")),
    "model.chat_template": (True, AUTHORS), "model.stop_tokens": (["<|eot_id|>"], AUTHORS),
    "lora.r": (128, AUTHORS), "lora.alpha": (64, AUTHORS), "lora.dropout": (0.05, AUTHORS),
    "lora.target_modules": (["q_proj", "k_proj", "v_proj", "up_proj"], listed("LoRA targets")),
    "output_dir": ("runs/llada-8b-instruct-gsm8k-d1-diffu-grpo", ours("path")), "task.name": ("gsm8k", AUTHORS),
    "task.options.path": ("data/gsm8k/{split}.jsonl", ours("path")), "task.options.convention": ("d1", AUTHORS),
    "task.options.completion_length": (256, AUTHORS),
    "objective.name": ("grpo", AUTHORS), "objective.clip_eps": (0.5, AUTHORS), "objective.ratio_level": ("token", AUTHORS),
    "objective.token_aggregation": ("batch_token_mean", listed("`batch_token_mean` divides by the scored tokens")),
    "objective.beta": (0.04, AUTHORS),
    "estimator.method": ("mean_field", AUTHORS), "estimator.num_samples": (1, AUTHORS),
    "estimator.options.p_prompt": (0.15, AUTHORS),
    "rollout.gen_length": (256, AUTHORS), "rollout.steps": (128, AUTHORS), "rollout.block_length": (32, AUTHORS),
    "rollout.temperature": (0.9, AUTHORS), "rollout.micro_batch": (6, AUTHORS), "rollout.max_prompt_length": (200, AUTHORS),
    "rollout.sort_by_length": (True, ours("less padding")), "rollout.noise": ("counter", ours("device-side noise")),
    "eval_sampling.gen_length": (256, AUTHORS), "eval_sampling.steps": (128, AUTHORS),
    "eval_sampling.block_length": (32, AUTHORS), "eval_sampling.temperature": (0.0, AUTHORS),
    "eval_sampling.noise": ("counter", ours("device-side noise")), "eval_sampling.micro_batch": (64, ours("memory")),
    "masks": ("shared", AUTHORS), "zero_variance_groups": ("keep", AUTHORS), "seed": (42, AUTHORS),
    "steps": (2000, listed("the recipe sets a 2,000-step budget")), "prompts_per_step": (16, AUTHORS),
    "accumulation_rounds": (2, AUTHORS), "group_size": (6, AUTHORS), "mu": (12, AUTHORS), "optimizer": ("adamw", AUTHORS),
    "lr": (3e-6, AUTHORS), "weight_decay": (0.1, AUTHORS), "grad_clip": (0.2, AUTHORS), "mixed_precision": ("bf16", AUTHORS),
    "eval_every": (100, listed("Evaluation every 100 steps is ours")), "eval_n": (1319, AUTHORS), "eval_split": ("test", AUTHORS),
    "save_every": (8, listed("d1's `save_steps: 100` counts optimizer steps")),
}
PINS = {"llada-8b-instruct-gsm8k-stabledrl": LLADA, "llada-8b-instruct-math-stabledrl": MATH,
        "dream-7b-instruct-gsm8k-stabledrl": DREAM, "sdar-8b-chat-gsm8k-stabledrl": SDAR,
        "llada-8b-instruct-gsm8k-d1-diffu-grpo": D1}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_every_setting_of_every_recipe_is_the_authors_or_listed_with_its_reason(name):
    import yaml

    written = _flat(yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text()))
    pins = PINS[name]
    assert sorted(written) == sorted(pins)  # a setting without its row, or a row without its setting
    assert {k: written[k] for k in pins} == {k: v for k, (v, _) in pins.items()}
    doc = (ROOT / "docs" / "recipes.md").read_text()
    rows = _deviation_rows(doc)
    for key, (value, source) in pins.items():
        if source == AUTHORS:
            continue
        kind, why = source
        if kind == "ours":
            assert "Settings that are ours" in doc and why, f"{name}: {key} is ours without a reason"
            continue
        # a row of the deviations table, for this recipe, naming the setting, with the reason
        mine = [r for r in rows if set(r[0].split(", ")) & FAMILIES[name] and f"`{key}" in r[1]]
        assert mine, f"{name}: no row of docs/recipes.md's deviations table names `{key}`"
        assert any(why in " | ".join(r) for r in mine), f"{name}: {key}'s row does not say {why!r}"


FAMILIES = {"llada-8b-instruct-gsm8k-stabledrl": {"StableDRL", "all"},
            "llada-8b-instruct-math-stabledrl": {"StableDRL", "LLaDA MATH", "all"},
            "dream-7b-instruct-gsm8k-stabledrl": {"StableDRL", "Dream", "all"},
            "sdar-8b-chat-gsm8k-stabledrl": {"SDAR", "all"}, "llada-8b-instruct-gsm8k-d1-diffu-grpo": {"d1", "all"}}
"""The names a recipe goes by in the first column of docs/recipes.md's deviations table."""


def _deviation_rows(doc: str) -> list[list[str]]:
    """The rows of the table under "## Where the recipes differ from the published runs": cells."""
    section = doc.split("## Where the recipes differ from the published runs", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Recipes")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]


def test_the_deviations_table_is_read_row_by_row():
    rows = _deviation_rows((ROOT / "docs" / "recipes.md").read_text())
    assert all(len(r) == 4 for r in rows), [r for r in rows if len(r) != 4]
    assert ["d1", "`save_every: 8`"] == rows[[r[1] for r in rows].index("`save_every: 8`")][:2]
    assert len(rows) >= 20
