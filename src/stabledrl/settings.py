"""The config dataclasses of `stabledrl train` and of the components it wires, importable
without torch: the command line reads and checks a config (`stabledrl.config.load_config`)
in well under a second, before the slow imports of training.

Each class is also importable from its component, as before (`stabledrl.sampling.SamplingConfig`,
`stabledrl.models.ModelConfig`, `stabledrl.models.lora.LoraSettings`, `stabledrl.sft.TaskConfig`).
This module imports only the standard library and `stabledrl.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from stabledrl.config import check

__all__ = ["METHODS", "ModelConfig", "LoraSettings", "SamplingConfig", "TaskConfig"]

METHODS: tuple[str, ...] = ("mc", "sdmc", "mean_field", "exact", "blockwise", "path")
"""The likelihood estimators (`stabledrl.likelihood`)."""


@dataclass
class ModelConfig:
    """The policy to load: a directory (or Hub name) and the adapter that reads it.

    In YAML, ``model: some/dir`` is short for ``model: {path: some/dir}``."""

    __shorthand__: ClassVar[str] = "path"

    path: str = "checkpoints/countdown-tiny"
    """Model directory (a stabledrl model, a run's checkpoint, a `transformers` checkpoint or a Hub name)."""
    adapter: Literal["auto", "tiny", "llada", "dream", "masked_lm", "decoder"] = "auto"
    """auto: from the checkpoint (stabledrl models, LLaDA, Dream); masked_lm and decoder must be named."""
    mask_token_id: int | None = None
    """The mask token; None: the checkpoint's config, then the tokenizer (an error if neither has one)."""
    block_size: int | None = None
    """decoder only: the block size S of the block-diffusion reading."""
    shift_logits: bool | None = None
    """True if the model's logits[:, i] predict token i+1; None: true for dream only."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    device: str = "auto"
    """auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:1 ...; in a multi-process run each
    process uses the device accelerate assigns it, on CPUs when this is cpu."""
    trust_remote_code: bool | None = None
    """Run the checkpoint's own modelling code; None: true for llada and dream only."""

    def __post_init__(self) -> None:
        check(bool(self.path), "model.path is empty: name a model directory")
        check(self.mask_token_id is None or self.mask_token_id >= 0,
              f"model.mask_token_id must be >= 0, got {self.mask_token_id}")
        check(self.block_size is None or self.block_size >= 1, f"model.block_size must be >= 1, got {self.block_size}")
        check(self.block_size is None or self.adapter in ("decoder", "auto"),
              "model.block_size is for the decoder adapter (tiny block models store theirs)")


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
    """How completions are sampled (rollouts and evaluation)."""

    gen_length: int | None = None
    """Completion slots L; None = the task's `completion_length`."""
    steps: int | None = None
    """Denoising steps T; None = L (one slot per step)."""
    block_length: int | None = None
    """Semi-autoregressive block size; None = one block of L."""
    temperature: float = 0.0
    """Gumbel temperature; 0 = greedy."""
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    """Which masked slots to commit each step."""
    kv_cache: bool = True
    """Block models: keep the keys/values of the prompt and finished blocks (same tokens, faster)."""

    def generate_kwargs(self) -> dict:
        """The keyword arguments of `generate` (all but gen_length and generator)."""
        return dict(steps=self.steps, block_length=self.block_length, temperature=self.temperature,
                    remasking=self.remasking, kv_cache=self.kv_cache)

    def __post_init__(self) -> None:
        for name in ("gen_length", "steps", "block_length"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"sampling.{name} must be a positive integer or null, got {v}")
        check(self.temperature >= 0, f"sampling.temperature must be >= 0, got {self.temperature}")


@dataclass
class TaskConfig:
    """Which task, with its options (e.g. num_numbers: 4 for Countdown)."""

    name: str = "countdown"
    """A registered task: countdown, sudoku."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor."""
