"""The config dataclasses of `stabledrl train`, `stabledrl sft` and the components they wire, importable
without torch: the command line reads and checks a config (`stabledrl.config.load_config`)
in well under a second, before the slow imports of training.

Each class is also importable from where it is used (`stabledrl.train.TrainConfig`,
`stabledrl.sft.SFTConfig`, `stabledrl.sft.TinyModelConfig`,
`stabledrl.sampling.SamplingConfig`, `stabledrl.models.ModelConfig`, `stabledrl.models.lora.LoraSettings`).
This module imports only the standard library and `stabledrl.config`. That is why `TaskConfig`
is here and not beside the tasks: importing `stabledrl.tasks` loads every task (numpy, 0.2 s), and
a config must be checked before any of that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from stabledrl.config import check

__all__ = ["METHODS", "Method", "Noise", "COUNTER_NOISE_VOCAB", "ApproxCache", "MAX_MU", "ModelConfig", "LoraSettings", "SamplingConfig", "TaskConfig", "TinyModelConfig",
           "RunConfig", "SFTConfig", "EstimatorConfig", "Normaliser", "TokenAggregation", "OBJECTIVE_SECTIONS",
           "ObjectiveSection", "StableDRLConfig", "GRPOConfig", "WD1Config", "SPGConfig", "ObjectiveConfig",
           "TrainConfig"]

Method = Literal["mc", "sdmc", "mean_field", "exact", "blockwise", "path", "coupled", "block_random"]
"""The likelihood estimators (`stabledrl.likelihood`, whose `PLANNERS` has one planner for each)."""
METHODS: tuple[str, ...] = get_args(Method)

Noise = Literal["auto", "generator", "counter"]
"""Where the sampler's noise comes from (`SamplingConfig.noise`)."""

COUNTER_NOISE_VOCAB = 32_768
"""`noise: auto` draws counter noise from a vocabulary of this many tokens up (`SamplingConfig.noise`)."""
ApproxCache = Literal["none", "prefix", "dual"]
"""Fast-dLLM's approximate caches of the full-attention sampler (`SamplingConfig.approx_cache`)."""

MAX_MU = 13
"""Inner iterations per step at most: `stabledrl.train` seeds 16 mask streams per step, 3 of
them for other draws (`stabledrl.seeds.SLOTS`)."""


@dataclass
class ModelConfig:
    """The policy to load: a directory (or Hub name) and the adapter that reads it.

    In YAML, ``model: some/dir`` is short for ``model: {path: some/dir}``."""

    __shorthand__: ClassVar[str] = "path"

    path: str = "checkpoints/countdown-tiny"
    """Model directory (a stabledrl model, a run's checkpoint, a `transformers` checkpoint or a Hub name)."""
    adapter: Literal["auto", "tiny", "llada", "dream", "sdar", "masked_lm", "decoder"] = "auto"
    """auto: from the checkpoint (stabledrl models, LLaDA, Dream, SDAR/TraDo); masked_lm and other decoders
    must be named. llada, dream and sdar run stabledrl's own code of the family (`stabledrl.models.native`)."""
    mask_token_id: int | None = None
    """The mask token; None: the checkpoint's config, then the tokenizer (an error if neither has one)."""
    block_size: int | None = None
    """decoder and sdar: the block size S of the block-diffusion reading; None: the checkpoint's (SDAR's config)."""
    prompt_attention: Literal["auto", "bidirectional", "sequence_blocks", "prompt_blocks"] = "auto"
    """decoder and sdar: where the prompt's blocks fall (docs/methods.md, "Policy interface"); auto: as saved
    with a stabledrl policy, else sequence_blocks (SDAR's and TraDo's)."""
    shift_logits: bool | None = None
    """True if the model's logits[:, i] predict token i+1; None: true for dream only."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    device: str = "auto"
    """auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:1 ...; in a multi-process run each
    process uses the device accelerate assigns it, on CPUs when this is cpu."""
    trust_remote_code: bool | None = None
    """Run the checkpoint's own modelling code instead of stabledrl's native llada, dream or sdar (docs/scale-out.md);
    None: off for those, on for a local checkpoint whose config.json names its code (auto_map), or as saved."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them: far less
    memory for the update, one more forward of compute (docs/scale-out.md)."""
    chat_template: bool | Literal["auto"] = "auto"
    """Wrap each prompt in the tokenizer's chat template, as instruct checkpoints expect: auto = when the
    tokenizer has one; true (YAML: on) = always; false (off) = the raw text (docs/scale-out.md)."""
    stop_tokens: list[int | str] = field(default_factory=list)
    """More tokens that end a completion, by id or by one token's text (e.g. ["<|eot_id|>"], LLaDA-Instruct's
    end of turn), besides EOS and the EOS ids of the checkpoint's generation config."""
    check_attention: bool = True
    """At load, refuse a full-attention model that attends causally or to padding (docs/scale-out.md,
    "Attention probe"); off only for a model whose attention you have checked yourself."""

    def __post_init__(self) -> None:
        check(bool(self.path), "model.path is empty: name a model directory")
        check(self.chat_template in (True, False, "auto"),
              f"model.chat_template must be auto, true (on) or false (off), got {self.chat_template!r}")
        for t in self.stop_tokens:
            check(isinstance(t, str) and t != "" or isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                  f"model.stop_tokens: {t!r} is neither a token id (>= 0) nor a token's text")
        check(self.mask_token_id is None or self.mask_token_id >= 0,
              f"model.mask_token_id must be >= 0, got {self.mask_token_id}")
        check(self.block_size is None or self.block_size >= 1, f"model.block_size must be >= 1, got {self.block_size}")
        check(self.block_size is None or self.adapter in ("decoder", "sdar", "auto"),
              "model.block_size is for the decoder and sdar adapters (tiny block models store theirs)")
        check(self.prompt_attention in ("auto", "bidirectional", "sequence_blocks", "prompt_blocks"),
              f"model.prompt_attention must be auto, bidirectional, sequence_blocks or prompt_blocks, "
              f"got {self.prompt_attention!r}")
        check(self.prompt_attention == "auto" or self.adapter in ("decoder", "sdar", "auto"),
              "model.prompt_attention is for the decoder and sdar adapters (tiny block models store theirs)")


@dataclass
class LoraSettings:
    """The `lora:` section of a training config."""

    r: int = 8
    """Rank of each adapter."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 keeps the update deterministic)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or suffixes) to adapt; ["all-linear"]: every linear layer but the output head."""

    def __post_init__(self) -> None:
        check(self.r >= 1, f"lora.r must be >= 1, got {self.r}")
        check(self.alpha > 0, f"lora.alpha must be positive, got {self.alpha}")
        check(0 <= self.dropout < 1, f"lora.dropout must be in [0, 1), got {self.dropout}")
        check(bool(self.target_modules), "lora.target_modules is empty: name modules or use ['all-linear']")


@dataclass
class SamplingConfig:
    """How completions are sampled (rollouts and evaluation): the options of
    `stabledrl.sampling.generate`, checked here once."""

    gen_length: int | None = None
    """Completion slots L; None = the task's `completion_length`."""
    steps: int | None = None
    """Denoising steps T; None = L (one slot per step)."""
    block_length: int | None = None
    """Semi-autoregressive block size. None: a block model decodes in its own blocks (it refuses any other),
    a full-attention model in one block of L (docs/methods.md, "Sampling")."""
    temperature: float = 0.0
    """Gumbel temperature; 0 = greedy."""
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    """Which masked slots to commit each step."""
    kv_cache: bool = True
    """Block models: keep the keys/values of the prompt and finished blocks (same tokens, faster)."""
    micro_batch: int | None = None
    """Rows per sampler call, to bound its memory; the tokens are the same (every row draws from
    its own generator). None: a process's rollouts of a step at once, evaluation 256 at a time."""
    sort_by_length: bool = False
    """Cut the micro-batches in order of prompt length, each call without the padding its rows share: faster
    for prompts of very different lengths (GSM8K, MATH); the same tokens but for rounding."""
    max_prompt_length: int | None = None
    """Keep each prompt's last N tokens, the left-padded batch cut from the left as TRL's and d1's
    ``max_prompt_length`` cuts it (the trainer then scores the prompt as cut); None: whole prompts."""
    noise: Noise = "auto"
    """Where the sampling noise comes from: generator (each row's CPU generator: the README's figures) or counter
    (on the device: far cheaper at large vocabularies, other tokens); auto: counter from 32,768 tokens up."""
    threshold: float | None = None
    """Fast-dLLM's parallel decoding, in (0, 1]: each step also commits every slot more confident than this, for
    fewer model calls (`steps` stays an upper bound); None or 1: the exact sampler's tokens."""
    approx_cache: ApproxCache = "none"
    """Fast-dLLM's approximate KV caches of a full-attention model, refreshed at each block's first step: prefix or
    dual, faster but another distribution; none: exact (docs/methods.md, "Fast decoding")."""
    approx_refresh: int | None = None
    """With approx_cache: also refresh the kept keys every this many calls of a block (1: exact); None: at a block's
    first call only. Samples nearer the exact ones, less speed (docs/experiments.md, "RL on approximate rollouts")."""
    cuda_graphs: bool = False
    """With approx_cache, on one GPU (no FSDP, ZeRO-3): a block's later calls replayed from a CUDA graph, the
    same kernels launched at once; the same tokens, not yet timed on a GPU (docs/methods.md, "Fast decoding")."""
    engine: str = "builtin"
    """What produces the trainer's rollouts: builtin (this sampler) or "package.module:ClassName", an external
    engine built with `engine_options` (docs/methods.md, "Rollout engines"); evaluations use builtin."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of an external engine's constructor."""

    def noise_for(self, vocab: int) -> str:
        """The noise this config draws for a model of `vocab` tokens (``auto`` made concrete)."""
        return self.noise if self.noise != "auto" else "counter" if vocab >= COUNTER_NOISE_VOCAB else "generator"

    def __post_init__(self) -> None:
        for name in ("gen_length", "steps", "block_length", "micro_batch", "max_prompt_length", "approx_refresh"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"sampling.{name} must be a positive integer or null, got {v}")
        check(self.temperature >= 0, f"sampling.temperature must be >= 0, got {self.temperature}")
        for name, choices in (("remasking", ("low_confidence", "random")), ("noise", get_args(Noise)),
                              ("approx_cache", get_args(ApproxCache))):
            check(getattr(self, name) in choices, f"sampling.{name} must be one of {', '.join(choices)}; "
                  f"got {getattr(self, name)!r}")
        check(self.threshold is None or 0 < self.threshold <= 1,
              f"sampling.threshold must be in (0, 1] or null, got {self.threshold}")
        check(self.threshold is None or self.remasking == "low_confidence",
              "sampling.threshold commits the slots whose confidence exceeds it: set remasking: low_confidence "
              "or threshold: null")
        check(not self.cuda_graphs or self.approx_cache != "none",
              "sampling.cuda_graphs replays the later calls of a cached block: set approx_cache: prefix or dual, "
              "or cuda_graphs: false")
        check(self.engine == "builtin" or self.engine.count(":") == 1 and all(self.engine.split(":")),
              f"sampling.engine must be 'builtin' or 'package.module:ClassName', got {self.engine!r}")
        check(self.engine != "builtin" or not self.engine_options,
              "sampling.engine_options are for an external engine; the builtin one takes its options from sampling")


@dataclass
class TaskConfig:
    """Which task, with its options (e.g. num_numbers: 4 for Countdown)."""

    name: str = "countdown"
    """A registered task (`stabledrl.tasks.available_tasks()`: countdown, sudoku, gsm8k, math, code, and yours)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor."""


@dataclass
class TinyModelConfig:
    """Size and attention of a new `TinyDiffusionLM`."""

    hidden_size: int = 192
    """Model width D."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 6
    """Attention heads; hidden_size / num_heads must be an even integer."""
    intermediate_size: int | None = None
    """SwiGLU hidden width; None = 4 * hidden_size."""
    attention_kind: Literal["full", "block"] = "full"
    """full: bidirectional (masked diffusion). block: block-causal (block diffusion)."""
    block_size: int | None = None
    """Block size S for attention_kind 'block'."""
    init_from: str | None = None
    """A saved model whose weights start the training (same sizes; the attention kind may
    differ, e.g. a block model initialised from a full-attention one). None = random."""

    def __post_init__(self) -> None:
        check(self.hidden_size > 0 and self.num_layers > 0 and self.num_heads > 0,
              "model.hidden_size, num_layers and num_heads must be positive")
        check(self.hidden_size % self.num_heads == 0 and (self.hidden_size // self.num_heads) % 2 == 0,
              f"model.hidden_size ({self.hidden_size}) / num_heads ({self.num_heads}) must be an even integer")
        check(self.attention_kind == "full" or (self.block_size or 0) > 0,
              "model.attention_kind 'block' needs model.block_size > 0")


@dataclass
class RunConfig:
    """What `stabledrl sft` and `stabledrl train` share: where a run writes, its schedule, its
    evaluations. A field without a default here takes each run's own (`SFTConfig`, `TrainConfig`)."""

    output_dir: str
    """Run directory: the resolved config, metrics, checkpoints, the final model (and SFT's eval.json;
    docs/logging.md)."""
    steps: int
    """Training steps (RL: each a round of rollouts and `mu` optimizer updates)."""
    lr: float
    """Peak learning rate (after warmup)."""
    min_lr_ratio: float
    """Final learning rate as a fraction of lr (cosine decay); 1.0 = constant."""
    warmup_steps: int
    """Linear warmup steps."""
    weight_decay: float
    """AdamW weight decay."""
    log_every: int
    """Steps between metric lines (metrics.jsonl, and RL's `report_to` backends)."""
    eval_every: int
    """Steps between held-out evaluations; 0: at the end only (RL also evaluates at the start)."""
    save_every: int
    """Steps between checkpoints (and at the end)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task trained and evaluated on, with its options."""
    seed: int = 0
    """Seeds every draw of the run (SFT: initialisation, data order, masks; RL: prompts, rollouts and masks,
    a step's depending only on (seed, step))."""
    grad_clip: float = 1.0
    """Max global gradient norm (the norm before clipping is logged, grad_norm)."""
    eval_n: int = 500
    """Held-out problems per evaluation (seed 0 of `eval_split`: the set `stabledrl eval` uses)."""
    eval_split: Literal["validation", "test"] = "test"
    """Split of the held-out evaluations: validation while choosing settings or a checkpoint, test to report."""
    threads: int | None = None
    """torch CPU threads; None = torch's default."""

    def __post_init__(self) -> None:
        for name in ("steps", "eval_n", "save_every", "log_every"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.lr > 0, f"lr must be positive, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(self.warmup_steps >= 0 and self.eval_every >= 0, "warmup_steps and eval_every must be >= 0")


@dataclass
class SFTConfig(RunConfig):
    """`stabledrl sft`: train a tiny masked-diffusion LM from scratch on a task."""

    # RunConfig's fields, with SFT's defaults
    output_dir: str = "runs/sft"
    steps: int = 4000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.01
    log_every: int = 20
    eval_every: int = 1000
    save_every: int = 500

    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling used by the evaluations."""
    batch_size: int = 256
    """Problems per step."""
    t_min: float = 1e-3
    """Smallest masking level t, keeps the 1/t weight finite."""
    stratified_t: bool = True
    """Spread t evenly over the batch (same marginal, lower variance)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.batch_size > 0, f"batch_size must be positive, got {self.batch_size}")
        check(0 < self.t_min < 1, f"t_min must be in (0, 1), got {self.t_min}")


@dataclass
class EstimatorConfig:
    """The likelihood estimator ℓ (see stabledrl.likelihood)."""

    method: Method = "mc"
    """mc (ELBO), sdmc (GDPO), mean_field (d1), coupled (DiffuCoder), exact (tiny L), blockwise (block models), path
    (the rollout's own order) or block_random (the authors' StableDRL); docs/methods.md, "Likelihood estimators"."""
    num_samples: int = 1
    """K: masks per sequence (per node for sdmc)."""
    options: dict[str, Any] = field(default_factory=dict)
    """mc: masking, stratified, antithetic; sdmc: num_nodes, weight; mean_field: p_prompt, prompt_columns; coupled:
    t_min, t_max; block_random: block_length, p_prompt; blockwise: inner, num_nodes, stratified (docs/methods.md)."""
    reduction: Literal["sum", "mean"] = "sum"
    """sum: a log-likelihood; mean: per scored token."""
    max_views_per_forward: int | None = None
    """Noised views per forward; None: all at once, one graph. Set, the update back-propagates a micro-batch of
    views at a time: memory independent of the views, one extra no-grad forward (docs/methods.md)."""

    def __post_init__(self) -> None:
        check(self.method in METHODS, f"estimator.method must be one of {METHODS}")
        check(self.num_samples >= 1, f"estimator.num_samples must be >= 1, got {self.num_samples}")
        check(self.method != "path" or (self.num_samples == 1 and not self.options),
              "estimator.method 'path' is deterministic and takes no options: set num_samples: 1 and no options")
        check(self.options.get("weight", "count") in ("count", "time"),
              f"estimator.options.weight must be count or time (sdmc), got {self.options.get('weight')!r}")


TokenAggregation = Literal["sequence_mean", "group_token_mean", "batch_token_mean", "constant"]
"""How GRPO's per-token terms become its loss (`GRPOConfig.token_aggregation`)."""

Normaliser = Literal["sequences", "tokens", "constant"]
"""What an objective's loss is divided by (`ObjectiveSection.normaliser`): the batch's sequences (a
mean over rows or groups), its scored tokens, or a constant that does not depend on the batch."""

OBJECTIVE_SECTIONS: dict[str, type[ObjectiveSection]] = {}
"""objective name -> its config section: each subclass of `ObjectiveSection` that sets its own
`name`, in the order they are defined (the first, stabledrl, is the default). The `objective:`
section of a config is the one its `name` picks; `stabledrl.objectives.objective` registers the loss."""


@dataclass
class ObjectiveSection:
    """What every objective's config section holds, and what it asks of the loop. An objective's
    options subclass it with a `name` (`name: Literal["mine"] = "mine"`), which registers them in
    `OBJECTIVE_SECTIONS` (docs/extending.md)."""

    __sections__: ClassVar[dict[str, type[ObjectiveSection]]] = OBJECTIVE_SECTIONS

    advantage_scale: Literal["none", "std", "leave_one_out"] = "none"
    """none: r − mean (StableDRL, d1, Dr. GRPO); std: divided by the group std (original GRPO);
    leave_one_out: r − the mean of the other G − 1 (DiffuCoder's coupled-GRPO)."""
    clip_eps: float = 0.2
    """ε of the [1−ε, 1+ε] clip (grpo, stabledrl two_sided), and the band of the ratio diagnostics'
    clip_fraction (every objective)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if isinstance(cls.__dict__.get("name"), str):  # its own name, not one inherited
            OBJECTIVE_SECTIONS[cls.__dict__["name"]] = cls

    def __post_init__(self) -> None:
        check(0 < self.clip_eps < 1, f"objective.clip_eps must be in (0, 1), got {self.clip_eps}")

    @property
    def normaliser(self) -> Normaliser:
        """What the loss is divided by, so that the accumulation rounds and grad_agreement's halves
        weigh their part of it: "sequences" by their rows, "tokens" by their scored tokens,
        "constant" each by 1 (their losses add up to the step's)."""
        return "sequences"

    @property
    def token_terms(self) -> bool:
        """Whether the objective reads per-token terms (B', L) instead of sequence estimates (B',)."""
        return False

    @property
    def eubo_beta(self) -> float | None:
        """The β of SPG's EUBO when the objective reads it (`ScoredBatch.eubo`), else None."""
        return None

    @property
    def weight_masks(self) -> bool:
        """Whether the objective reads ℓ on a separate mask draw (`ScoredBatch.weight_logp`)."""
        return False

    @property
    def needs_reference(self) -> bool:
        """Whether the objective reads ℓ under the initial policy (`ScoredBatch.ref_logp`)."""
        return False


@dataclass
class StableDRLConfig(ObjectiveSection):
    """StableDRL: unconditional clip, group self-normalised weights (`stabledrl.objectives.stabledrl_loss`)."""

    name: Literal["stabledrl"] = "stabledrl"
    clip: Literal["upper", "two_sided"] = "upper"
    """upper: min(ρ, clip_max) (authors' code); two_sided: clip(ρ, 1−ε, 1+ε) (paper)."""
    clip_max: float = 5.0
    """The upper clip c."""
    ratio_level: Literal["sequence", "sequence_normalized"] = "sequence"
    """sequence: exp(ℓ−ℓ_old); sequence_normalized: divided by |y| (GDPO)."""
    likelihood: Literal["estimator", "spg"] = "estimator"
    """The ℓ in the gradient: estimator (as in the weights) or spg (SPG's ELBO/EUBO sandwich, the estimator's ℓ
    in the weights: the authors' StableDRL; docs/methods.md, "StableDRL")."""
    spg_beta: float = 1.5
    """likelihood spg: the EUBO's β (`stabledrl.likelihood.eubo`)."""
    spg_omega: float = 0.5
    """likelihood spg: the EUBO's share ω of the sandwich where A ≤ 0."""
    separate_weight_masks: bool = False
    """Compute the weights' likelihoods on a separate mask draw (docs/methods.md, "Open questions")."""

    @property
    def eubo_beta(self) -> float | None:
        return self.spg_beta if self.likelihood == "spg" else None

    @property
    def weight_masks(self) -> bool:
        return self.separate_weight_masks

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.clip_max > 1, f"objective.clip_max must be > 1, got {self.clip_max}")
        _check_sandwich(self.spg_beta, self.spg_omega)
        check(self.likelihood == "estimator" or self.ratio_level == "sequence",
              "SPG's sandwich is a per-sequence likelihood: set objective.ratio_level: sequence")
        check(self.likelihood == "estimator" or not self.separate_weight_masks,
              "objective.separate_weight_masks is for the estimator's ℓ, not SPG's sandwich")


@dataclass
class GRPOConfig(ObjectiveSection):
    """GRPO: conditional clip, 1/G, an optional k3 KL term (`stabledrl.objectives.grpo_loss`)."""

    name: Literal["grpo"] = "grpo"
    ratio_level: Literal["sequence", "sequence_normalized", "token"] = "sequence"
    """sequence: exp(ℓ−ℓ_old); sequence_normalized: divided by |y| (GDPO); token: per token (d1, mean_field)."""
    beta: float = 0.0
    """Weight of the k3 KL to the initial policy."""
    token_aggregation: TokenAggregation = "sequence_mean"
    """How the per-token terms (and the KL's) become the loss: sequence_mean (GRPO), group_token_mean (DAPO),
    batch_token_mean (d1's trainer) or constant (Dr. GRPO); docs/methods.md, "GRPO"."""

    @property
    def token_terms(self) -> bool:
        return self.ratio_level == "token"

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @property
    def normaliser(self) -> Normaliser:
        return {"batch_token_mean": "tokens", "constant": "constant"}.get(self.token_aggregation, "sequences")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.beta >= 0, f"objective.beta must be >= 0, got {self.beta}")
        check(self.token_aggregation == "sequence_mean" or self.ratio_level == "token",
              f"objective.token_aggregation {self.token_aggregation} needs per-token terms: set ratio_level: token")


@dataclass
class WD1Config(ObjectiveSection):
    """wd1: ratio-free weighted likelihood, softmax(ψA) up and softmax(−ψA) down (`stabledrl.objectives.wd1_loss`)."""

    name: Literal["wd1"] = "wd1"
    psi: float = 1.0
    """The inverse temperature ψ of its weights softmax(±ψA)."""
    ratio_level: Literal["sequence", "sequence_normalized"] = "sequence"
    """The ratio of the diagnostics: sequence, or sequence_normalized (divided by |y|)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.psi > 0, f"objective.psi must be positive, got {self.psi}")


@dataclass
class SPGConfig(ObjectiveSection):
    """SPG: ratio-free policy gradient on its ELBO/EUBO sandwich (`stabledrl.objectives.spg_loss`)."""

    name: Literal["spg"] = "spg"
    spg_beta: float = 1.5
    """The EUBO's β (`stabledrl.likelihood.eubo`)."""
    spg_omega: float = 0.5
    """The EUBO's share ω of the sandwich where A ≤ 0."""

    @property
    def eubo_beta(self) -> float | None:
        return self.spg_beta

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_sandwich(self.spg_beta, self.spg_omega)


def _check_sandwich(beta: float, omega: float) -> None:
    check(beta > 0, f"objective.spg_beta must be positive, got {beta}")
    check(0 <= omega <= 1, f"objective.spg_omega must be in [0, 1], got {omega}")


ObjectiveConfig = ObjectiveSection
"""The `objective:` section: the subclass of `OBJECTIVE_SECTIONS` that its `name` picks."""


@dataclass
class TrainConfig(RunConfig):
    """`stabledrl train`: RL from a saved policy."""

    # RunConfig's fields, with RL's defaults
    output_dir: str = "runs/train"
    steps: int = 100
    lr: float = 1e-5
    min_lr_ratio: float = 1.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 50

    model: ModelConfig = field(default_factory=ModelConfig)
    """The initial policy (also the KL reference and drift baseline); `model: dir` is short for `model: {path: dir}`."""
    lora: LoraSettings | None = None
    """Train LoRA adapters instead of every weight; the reference is then the base model (adapters off)."""
    objective: ObjectiveConfig = field(default_factory=StableDRLConfig)
    """The objective, by `name` (`OBJECTIVE_SECTIONS`): stabledrl (default), grpo, wd1, spg, or one
    registered from your code, each with its own options."""
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    rollout: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0))
    """Sampling of the rollouts (temperature > 0 for diverse groups)."""
    eval_sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling of the held-out evaluation (greedy by default, as `stabledrl eval`); a block
    model in its own blocks (`SamplingConfig.block_length`)."""
    masks: Literal["shared", "independent"] = "shared"
    """shared: ℓ_θ on ℓ_old's masks (common random numbers); independent: fresh masks."""
    zero_variance_groups: Literal["keep", "skip", "resample"] = "skip"
    """Groups whose rewards are all equal (no signal): keep them, skip them, or skip them and roll out fresh
    prompts to refill the step (resample, DAPO's; docs/methods.md, "The training step")."""
    max_resample_rounds: int = 2
    """resample: extra rollout rounds per step at most (each costs a rollout of the missing groups)."""
    prompts_per_step: int = 16
    """Distinct training problems per step."""
    group_size: int = 8
    """G: completions per prompt."""
    mu: int = 1
    """Inner optimizer iterations per batch of rollouts."""
    accumulation_rounds: int = 1
    """R: score and back-propagate the step's groups in R rounds, one round's graph at a time, into one optimizer
    step (TRL's gradient_accumulation_steps): less memory, the same gradient (docs/methods.md)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw, or plain sgd (no momentum: the update is −lr·g, which makes updates easy to compare)."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = field(default_factory=lambda: ["tensorboard"])
    """Where metrics, the config and each evaluation's table of sample completions go besides
    metrics.jsonl and samples.jsonl: any of tensorboard, wandb, trackio, or [] (docs/logging.md)."""
    grad_agreement: bool = False
    """Log the cosine between the policy gradients of the step's two halves of groups (near 0: the batch is too
    small to learn from); costs a second backward pass (docs/methods.md, "The training step")."""
    update_norm: bool = False
    """Log the norm of the change each optimizer step makes to the weights (the same weights: the optimizer
    steps a chunk at a time to bound the copy; docs/scale-out.md)."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: compute the forward passes in bfloat16 while weights, gradients and AdamW states stay in model.dtype:
    the recommended precision on GPUs (docs/scale-out.md); overrides the accelerate config's."""
    drift_kl: bool = False
    """Score the rollouts under the initial policy each step for the drift_kl and drift_k3 diagnostics; costs a
    forward and, without LoRA, a second copy of the model, hence off by default (docs/scale-out.md)."""
    keep_checkpoints: int = 2
    """Checkpoints kept (the newest), each the model and AdamW's state: 16 bytes a parameter at full fine-tuning
    (the preflight prints the run's disk; docs/scale-out.md)."""
    final_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype of the model the run hands over (final/); auto: bfloat16 under mixed_precision
    bf16 (the precision it computes in, as the published checkpoints), else model.dtype."""
    preflight: bool = True
    """Before the model loads, refuse a run that the memory model predicts cannot fit the memory
    a process has or the disk its checkpoints need (`stabledrl.preflight`); false: only print it."""

    @property
    def final_precision(self) -> str | None:
        """The dtype final/ is written in (`final_dtype` made concrete); None: the model's own."""
        if self.final_dtype != "auto":
            return self.final_dtype
        return "bfloat16" if self.mixed_precision == "bf16" else None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.max_resample_rounds <= 63,  # stabledrl.seeds: 64 resampling streams per step
              f"max_resample_rounds must be in [0, 63], got {self.max_resample_rounds}")
        for name in ("prompts_per_step", "group_size", "mu", "keep_checkpoints"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.accumulation_rounds >= 1, f"accumulation_rounds must be >= 1, got {self.accumulation_rounds}")
        check(self.prompts_per_step % self.accumulation_rounds == 0,
              f"prompts_per_step ({self.prompts_per_step}) must be a multiple of accumulation_rounds "
              f"({self.accumulation_rounds}): each round holds prompts_per_step / accumulation_rounds groups")
        check(not (self.grad_agreement and self.accumulation_rounds > 1),
              "grad_agreement needs the one-round update: set accumulation_rounds: 1")
        check(self.mu <= MAX_MU, f"mu must be at most {MAX_MU} (each inner iteration has its own seed slot)")
        check(self.group_size >= 2, "group_size must be >= 2: advantages compare completions of one prompt")
        check(self.optimizer == "adamw" or self.weight_decay == 0, "weight_decay is an adamw option; set it to 0")
        check(self.objective.eubo_beta is None or self.estimator.max_views_per_forward is None,
              "SPG's EUBO is not linear in the views' terms: leave estimator.max_views_per_forward unset")
        check(not (self.grad_agreement and self.estimator.max_views_per_forward is not None),
              "grad_agreement needs the one-graph update: leave estimator.max_views_per_forward unset")
        check(self.lora is not None or self.model.dtype == "float32",
              f"model.dtype {self.model.dtype} trains the weights in {self.model.dtype}, where an update smaller "
              "than half their rounding step is lost (an AdamW step at lr 1e-6 on every bfloat16 weight larger than "
              "about 5e-4). Keep model.dtype: "
              "float32 and set mixed_precision: bf16 to compute in bfloat16 (with LoRA the base may be bfloat16)")
        check(self.eval_sampling.engine == "builtin",
              "eval_sampling.engine: held-out accuracy is measured with the built-in sampler; set the engine "
              "under rollout")
        check(self.rollout.temperature > 0 or self.rollout.remasking == "random",
              "rollout.temperature is 0 with low_confidence remasking: every completion of a group would be "
              "identical; set rollout.temperature > 0")
