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
           "SFTConfig", "EstimatorConfig", "Normaliser", "TokenAggregation", "OBJECTIVE_SECTIONS", "ObjectiveSection",
           "StableDRLConfig", "GRPOConfig", "WD1Config", "SPGConfig", "ObjectiveConfig", "TrainConfig"]

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
them for other draws (its `_SEED_SLOTS`)."""


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
    """decoder and sdar: where the prompt's blocks fall (`stabledrl.models.attention`). auto: as saved with a
    stabledrl policy, else sequence_blocks (SDAR's and TraDo's: blocks of S over the whole sequence from its
    first token, so the prompt's tail shares the first completion block); prompt_blocks: the prompt's blocks
    end where it ends (dLLM-RL's trainers); bidirectional: the prompt is one block (stabledrl's tiny block
    models, which store theirs)."""
    shift_logits: bool | None = None
    """True if the model's logits[:, i] predict token i+1; None: true for dream only."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    device: str = "auto"
    """auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:1 ...; in a multi-process run each
    process uses the device accelerate assigns it, on CPUs when this is cpu."""
    trust_remote_code: bool | None = None
    """Run the checkpoint's own modelling code instead of stabledrl's (llada, dream and sdar: the published files,
    which keep no KV cache and need transformers < 4.58 for LLaDA and Dream; docs/scale-out.md); None: false for
    llada, dream and sdar, true for another local checkpoint whose config.json names its code (auto_map), and as
    saved with a stabledrl policy."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them
    (memory of the update: one block's activations per view plus the blocks' inputs; one more
    forward of compute). Every adapter, through the model's own hook: the tiny models', LLaDA's
    set_activation_checkpointing, transformers' gradient_checkpointing_enable (also in the eval
    mode the update runs in); a model with none is refused at load."""
    chat_template: bool | Literal["auto"] = "auto"
    """Wrap every prompt in the tokenizer's chat template as one user turn followed by the
    assistant's generation prompt (instruct checkpoints expect it): auto = when the tokenizer has
    a template (the shipped models have none); true (YAML: on) = always, an error if it has none;
    false (off) = the raw prompt text. Training, evaluation and `stabledrl sample` all encode
    prompts this way; saved with an adapter policy."""
    stop_tokens: list[int | str] = field(default_factory=list)
    """More tokens that end a completion, by id or by text (e.g. ["<|eot_id|>"], LLaDA-Instruct's
    end of turn), besides EOS and the EOS ids of the checkpoint's generation config; each text
    must be one token of the tokenizer. Saved with an adapter policy."""
    check_attention: bool = True
    """At load, probe a full-attention model with two rows (one left-padded): refuse it if it is
    causal or lets padding in (docs/scale-out.md says what to do). Off only for a model whose
    attention you have checked yourself."""

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
    """Semi-autoregressive block size. None: a block model (the tiny block models, the decoder
    adapter: SDAR) decodes in its own blocks of `block_size`, and any other value is refused; a
    full-attention model (LLaDA, Dream) decodes one block of L, as its checkpoint stores no block
    convention of its own: their recipes set block_length and steps for rollouts and evaluation."""
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
    """Cut the rows into micro-batches in order of prompt length (with several micro-batches), each
    call dropping the left padding its rows all have (prompts of very different lengths: GSM8K,
    MATH). Outputs in the given order; a row's tokens are the same but for rounding (a different
    number of hidden padding keys; `stabledrl.sampling.generate_micro_batched`)."""
    max_prompt_length: int | None = None
    """Keep each prompt's last N tokens, the left-padded batch cut from the left as TRL's and d1's
    ``max_prompt_length`` cuts it (the trainer then scores the prompt as cut); None: whole prompts."""
    noise: Noise = "auto"
    """Where the sampling noise comes from. generator: each row's CPU generator, float64 Gumbel
    noise over every completion column and the whole vocabulary, copied to the device (the stream
    every figure of the README was made with). counter: one counter-based uniform per decoded
    slot, a hash of (the row's key, drawn from its generator; the step; the column), made on the
    model's device for the slots being decoded only, and an inverse-CDF draw: far cheaper at a
    large vocabulary, still reproducible per row. Same distribution, other tokens: switching
    changes every sampled completion (greedy decoding is unchanged). auto: counter when the
    model's vocabulary has at least 32,768 tokens (`COUNTER_NOISE_VOCAB`), else generator. At
    LLaDA's 126k tokens the generator's noise is 8 GB of float64 per step of 32 rows of 256
    slots, made on the CPU; the shipped tiny models (a few dozen tokens) pay nothing for it and
    keep their figures. Every real dLLM has 100k+ tokens, every character model < 1k: any
    threshold between splits them; a power of two near the smallest BPE vocabularies (32k) does."""
    threshold: float | None = None
    """Confidence-threshold parallel decoding (Fast-dLLM), in (0, 1]: each step also commits every
    eligible slot whose confidence exceeds the threshold, and at least the schedule's
    ceil(masked left / steps left), so `steps` stays an upper bound. Needs low_confidence
    remasking. None or 1: the exact sampler's tokens. Fewer model calls, but processes with
    sharded parameters (synced) still make every call of the schedule."""
    approx_cache: ApproxCache = "none"
    """Full-attention models with a KV cache (the tiny models and the native llada and dream; a
    checkpoint's own code has none and is refused): Fast-dLLM's approximate caches, refreshed at
    each block's first step (with block_length < L; one block caches the prompt alone). prefix: later steps feed the block and
    what follows it, attending to the kept prefix; dual: they feed the block alone, attending to
    the kept prefix and suffix. An approximation of the exact sampler (other tokens, another
    distribution); none: exact."""
    approx_refresh: int | None = None
    """With approx_cache: also refresh the kept keys and values (a whole-sequence call) every this
    many calls within a block; None: at each block's first call only (Fast-dLLM's). 1 is the exact
    sampler at its cost. The knob between the cache's speed and how far its samples stray
    (docs/experiments.md, "RL on approximate rollouts")."""
    engine: str = "builtin"
    """What produces the trainer's rollouts (`stabledrl.engines`): builtin (this library's sampler,
    with every option above) or an external engine, "package.module:ClassName", imported by name
    and built with `engine_options`. Evaluations always use the built-in sampler (the yardstick)."""
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
class SFTConfig:
    """`stabledrl sft`: train a tiny masked-diffusion LM from scratch on a task."""

    output_dir: str = "runs/sft"
    """Run directory: config, metrics, checkpoints, final model, eval JSON."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling used by the evaluations."""
    seed: int = 0
    """Seeds initialisation, data order and masks."""
    steps: int = 4000
    """Optimizer steps."""
    batch_size: int = 256
    """Problems per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine decay)."""
    warmup_steps: int = 200
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    t_min: float = 1e-3
    """Smallest masking level t, keeps the 1/t weight finite."""
    stratified_t: bool = True
    """Spread t evenly over the batch (same marginal, lower variance)."""
    log_every: int = 20
    """Steps between metric lines."""
    eval_every: int = 1000
    """Steps between held-out evaluations (0 = only at the end)."""
    eval_n: int = 500
    """Held-out problems per evaluation (seed 0 of `eval_split`: the set `stabledrl eval` uses)."""
    eval_split: Literal["validation", "test"] = "test"
    """Split of the evaluations: validation when you choose a checkpoint or a setting by them."""
    save_every: int = 500
    """Steps between checkpoints."""
    threads: int | None = None
    """torch CPU threads; None = torch's default."""

    def __post_init__(self) -> None:
        check(self.steps > 0, f"steps must be positive, got {self.steps}")
        check(self.batch_size > 0, f"batch_size must be positive, got {self.batch_size}")
        check(self.lr > 0, f"lr must be positive, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(0 < self.t_min < 1, f"t_min must be in (0, 1), got {self.t_min}")
        check(self.warmup_steps >= 0 and self.eval_every >= 0, "warmup_steps and eval_every must be >= 0")
        check(self.log_every > 0 and self.save_every > 0, "log_every and save_every must be positive")
        check(self.eval_n > 0, f"eval_n must be positive, got {self.eval_n}")


@dataclass
class EstimatorConfig:
    """The likelihood estimator ℓ (see stabledrl.likelihood)."""

    method: Method = "mc"
    """mc (ELBO), sdmc (GDPO), mean_field (d1), coupled (DiffuCoder's complementary views), exact
    (enumeration, tiny L only); blockwise
    for block-diffusion models (per-block ELBO terms in one staircase pass); path (either
    kind: the log-probability along the rollout's own decoding order, num_samples 1); block_random
    (SPG's block masks with prompt masking, a per-token-mean ELBO: the authors' StableDRL)."""
    num_samples: int = 1
    """K: masks per sequence (per node for sdmc)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Method options: mc: masking, stratified, antithetic; sdmc: num_nodes, weight (count: n/k per
    node, ours; time: 1/t, GDPO's; docs/methods.md); mean_field: p_prompt, prompt_columns (tokens | all,
    d1's); coupled: t_min, t_max; block_random: block_length, p_prompt; blockwise: inner (mc | sdmc |
    exact), num_nodes, stratified."""
    reduction: Literal["sum", "mean"] = "sum"
    """sum: a log-likelihood; mean: per scored token."""
    max_views_per_forward: int | None = None
    """Noised views per forward. None: all at once, one graph for the update. Set: the
    update scores ℓ without a graph, takes ∂loss/∂ℓ, and back-propagates one micro-batch
    of views at a time (one extra no-grad forward; memory independent of the views)."""

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
    """The ℓ in the gradient. estimator: the estimator's ℓ (weights and gradient alike). spg: SPG's
    sandwich, the ELBO where A > 0 and spg_omega·EUBO + (1 − spg_omega)·ELBO elsewhere, with the
    estimator's ℓ (the ELBO) in the weights: the authors' StableDRL (docs/methods.md)."""
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
    """How token ratios' per-token terms (and the KL's) become the loss: sequence_mean (each completion's
    mean, then the mean over completions: GRPO), group_token_mean (each group's token mean, then the
    mean over groups: DAPO), batch_token_mean (the batch's token mean: d1's trainer), constant (the
    sum over tokens / (P·G·L), P·G the step's rows, L the slots: Dr. GRPO). docs/methods.md, "GRPO"."""

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
class TrainConfig:
    """`stabledrl train`: RL from a saved policy."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The initial policy (also the KL reference and drift baseline); `model: dir` is short for `model: {path: dir}`."""
    lora: LoraSettings | None = None
    """Train LoRA adapters instead of every weight; the reference is then the base model (adapters off)."""
    output_dir: str = "runs/train"
    """Run directory: config, metrics.jsonl, TensorBoard, checkpoints, final model."""
    task: TaskConfig = field(default_factory=TaskConfig)
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
    """Groups whose rewards are all equal (zero advantage, no signal): keep them, skip them,
    or skip them and roll out fresh prompts to refill the step (up to max_resample_rounds).
    Counters: `zero_variance_groups` counts every such group rolled out, in every round;
    `resampled_groups` counts the groups rolled out in extra rounds (kept or not); the
    step's `zero_variance_fraction` and reward statistics describe the first round only."""
    max_resample_rounds: int = 2
    """resample: extra rollout rounds per step at most (each costs a rollout of the missing groups)."""
    seed: int = 0
    """Seeds the prompts, rollouts and masks of every step (a step's draws depend only on (seed, step))."""
    steps: int = 100
    """RL steps (each: rollouts + mu optimizer updates)."""
    prompts_per_step: int = 16
    """Distinct training problems per step."""
    group_size: int = 8
    """G: completions per prompt."""
    mu: int = 1
    """Inner optimizer iterations per batch of rollouts."""
    accumulation_rounds: int = 1
    """R: score and back-propagate the step's kept groups in R rounds of whole groups (at most
    prompts_per_step / R each), holding one round's graph at a time and accumulating the
    gradients into one optimizer step per inner iteration (the StableDRL authors'
    grad_accumulation, TRL's gradient_accumulation_steps). Each round's loss counts by its
    share of the step's loss (by the objective's `normaliser`: its rows, its scored tokens, or 1), so the
    gradient is the one-round step's up to rounding (docs/methods.md, "The training step").
    The rollouts are sampled in one pass whatever R (rollout.micro_batch bounds its memory)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw, or plain sgd (no momentum: the update is −lr·g, which makes updates easy to compare)."""
    lr: float = 1e-5
    """Learning rate."""
    min_lr_ratio: float = 1.0
    """Final lr / lr (cosine); 1.0 = constant."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (the norm before clipping is logged)."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: start and end only)."""
    eval_n: int = 500
    """Held-out problems (seed 0 of `eval_split`: the set `stabledrl eval` uses)."""
    save_every: int = 50
    """Steps between checkpoints (and at the end)."""
    log_every: int = 1
    """Steps between metric lines (metrics.jsonl and each report_to backend)."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = field(default_factory=lambda: ["tensorboard"])
    """Where metrics, the config and each evaluation's table of sample completions go besides
    metrics.jsonl and samples.jsonl: any of tensorboard, wandb, trackio, or [] (docs/logging.md)."""
    threads: int | None = None
    """torch CPU threads; None = torch's default."""
    grad_agreement: bool = False
    """Log `grad_agreement`, the cosine between the policy gradients of the two halves of the
    step's kept groups (first inner iteration; README "RL that learns"): near 0, the batch is
    too small to learn from. Costs a second backward pass; one process, no view budget."""
    update_norm: bool = False
    """Log `update_norm`, the norm of the change each optimizer step makes to the weights. The
    optimizer then steps the parameters a chunk at a time (same weights, bit for bit) so that
    only a chunk is copied to take the difference."""
    eval_split: Literal["validation", "test"] = "test"
    """Split of the held-out evaluations: validation while choosing settings, test to report."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: the forward passes compute in bfloat16 (autocast, through accelerate; under FSDP
    also the gathered parameters) while the weights, gradients and AdamW states stay in
    model.dtype, float32: the recommended precision on GPUs, no update lost to rounding
    (docs/scale-out.md). It overrides the accelerate config's mixed_precision."""
    drift_kl: bool = False
    """Score the rollouts under the initial policy each step for the `drift_kl` and `drift_k3`
    diagnostics. Costs a forward and, without LoRA, a second full copy of the model on every
    process, hence off by default (an 8B model's is 32 GB in float32); the shipped tiny presets
    turn it on. A KL term (beta > 0) loads the reference whatever this says."""
    keep_checkpoints: int = 2
    """Checkpoints kept (the newest); one more exists while the next is saved. Each holds the
    model and the resume state (AdamW's m and v; under FSDP the model's shards): 16 bytes a
    parameter at full fine-tuning (128 GB for an 8B model; the preflight prints the run's total)."""
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
        check(0 <= self.max_resample_rounds <= 63,  # _resample_seed keeps 64 streams per step
              f"max_resample_rounds must be in [0, 63], got {self.max_resample_rounds}")
        for name in ("steps", "prompts_per_step", "group_size", "mu", "eval_n", "save_every", "log_every",
                     "keep_checkpoints"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.accumulation_rounds >= 1, f"accumulation_rounds must be >= 1, got {self.accumulation_rounds}")
        check(self.prompts_per_step % self.accumulation_rounds == 0,
              f"prompts_per_step ({self.prompts_per_step}) must be a multiple of accumulation_rounds "
              f"({self.accumulation_rounds}): each round holds prompts_per_step / accumulation_rounds groups")
        check(not (self.grad_agreement and self.accumulation_rounds > 1),
              "grad_agreement needs the one-round update: set accumulation_rounds: 1")
        check(self.mu <= MAX_MU, f"mu must be at most {MAX_MU} (each inner iteration has its own seed slot)")
        check(self.group_size >= 2, "group_size must be >= 2: advantages compare completions of one prompt")
        check(self.lr > 0, f"lr must be positive, got {self.lr}")
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
