"""The policy interface every estimator, sampler and trainer talks to
(docs/methods.md, "Policy interface").

A policy gives logits for a batch of (possibly noised) token sequences, with
``logits[:, i]`` predicting token ``i``; knows its mask token (required, never guessed);
and says which attention it uses: ``full`` (LLaDA, Dream, MDLM) or ``block`` with a block
size (SDAR, BD3-LM). Adapters for real checkpoints implement the same protocol.

A block policy takes a boolean (B, T, T) mask (`stabledrl.models.attention`) and says
where its prompt's blocks fall, ``prompt_attention`` (one of
`stabledrl.models.attention.PROMPT_ATTENTION`; read where present, else
``bidirectional``): the sampler, the likelihood and SFT all build their masks from it. One
that can cache keys and values also has ``new_cache()`` and accepts ``cache=`` and
``extend_cache=`` in `logits`; the block sampler uses them when present.

Optional attributes, read where present (both policies here have them): ``chat_template``
(bool: prompts are wrapped in the tokenizer's chat template) and ``stop_token_ids`` (the
tokens that end a completion; else EOS alone). See `stabledrl.models.prompting`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from stabledrl import _compat
from stabledrl.data import completion_stop_ids
from stabledrl.models.adapters import ADAPTER_FILE, ADAPTERS, load_hf_policy
from stabledrl.models.attention import check_prompt_attention
from stabledrl.models.prompting import resolve_chat_template, resolve_stop_tokens
from stabledrl.models.tiny import KVCache, TinyDiffusionConfig, TinyDiffusionLM
from stabledrl.settings import ModelConfig  # defined without torch, for the command line

__all__ = ["Policy", "TinyPolicy", "ModelConfig", "load_policy", "resolve_adapter"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# model_type in a checkpoint's config.json -> adapter, for `adapter: auto`.
_MODEL_TYPES = {TinyDiffusionConfig.model_type: "tiny", "llada": "llada", "dream": "dream",
                "sdar": "sdar"}  # SDAR and TraDo


@runtime_checkable
class Policy(Protocol):
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    mask_token_id: int
    pad_token_id: int
    eos_token_id: int
    attention_kind: Literal["full", "block"]
    block_size: int | None

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, V) logits; logits[:, i] predicts token i."""
        ...


@dataclass
class TinyPolicy:
    """`TinyDiffusionLM` (or any model whose logits are unshifted) behind the interface."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None: when it has one (the shipped
    tokenizers have none). Resolved to a bool at construction."""
    stop_tokens: tuple[int | str, ...] = ()
    """Stop tokens besides EOS, by id or text (resolved to ids at construction); `stop_token_ids`
    is EOS and these. Not saved with the model: give them again when loading it."""

    def __post_init__(self) -> None:
        cfg = self.model.config
        mask_id = getattr(cfg, "mask_token_id", None)
        if mask_id is None:
            mask_id = self.tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError("the model config and the tokenizer both lack mask_token_id; set one")
        if mask_id == self.tokenizer.pad_token_id:
            raise ValueError(f"mask_token_id {mask_id} equals pad_token_id: they must differ")
        if self.tokenizer.eos_token_id is None or self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs both an EOS and a PAD token")
        self.mask_token_id = int(mask_id)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.chat_template = resolve_chat_template(self.tokenizer, self.chat_template)
        self.stop_tokens = resolve_stop_tokens(self.tokenizer, self.stop_tokens,
                                               getattr(cfg, "vocab_size", len(self.tokenizer)))
        self.stop_token_ids = completion_stop_ids(self.tokenizer, (self.eos_token_id, *self.stop_tokens))
        if self.mask_token_id in self.stop_token_ids:
            raise ValueError(f"mask_token_id {self.mask_token_id} is one of the stop tokens {self.stop_token_ids}")
        self.attention_kind = getattr(cfg, "attention_kind", "full")
        self.block_size = getattr(cfg, "block_size", None)
        # stabledrl's block models read the prompt as one bidirectional block (they are trained so);
        # a config may name another convention (`stabledrl.models.attention`).
        self.prompt_attention = getattr(cfg, "prompt_attention", "bidirectional")
        check_prompt_attention(self.prompt_attention)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        extend_cache: bool = False,
        columns: slice | None = None,
    ) -> torch.Tensor:
        """Logits of `input_ids`; with `cache`, the new tokens also attend to the cached
        ones (the mask's first columns), and `extend_cache` appends them to it. `columns`:
        (B, W, V), the logits of those columns only, the head run on them alone."""
        own = isinstance(self.model, TinyDiffusionLM)  # another model computes every column's, then cut
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, extend_cache=extend_cache, **({"logits_columns": columns} if own else {}),
        ).logits
        return out[:, columns] if columns is not None and not own else out

    def new_cache(self) -> KVCache:
        return KVCache()

    @property
    def cache_in_place(self) -> bool:
        """The model writes a `KVCache` in place where it says (`KVCache.write_at`): the tiny one,
        also under DDP's and peft's wrappers (which pass the cache through)."""
        model = getattr(self.model, "module", self.model)  # DDP
        if hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        return isinstance(model, TinyDiffusionLM)

    def save(self, path: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`state_dict`: the weights to write instead of the model's own (the full weights
        gathered from sharded processes)."""
        _compat.save_pretrained(self.model, path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)


def resolve_adapter(path: str | Path, adapter: str = "auto") -> str:
    """The adapter for `path`: the named one, or what its config.json says."""
    if adapter != "auto":
        return adapter
    path = Path(path)
    if (path / ADAPTER_FILE).is_file():
        return json.loads((path / ADAPTER_FILE).read_text())["adapter"]
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a saved model directory (no config.json); for a Hub model "
                                f"name the adapter (model.adapter: one of {ADAPTERS})")
    model_type = json.loads(config_file.read_text()).get("model_type")
    model_type = model_type.lower() if isinstance(model_type, str) else model_type  # Dream's is "Dream"
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{path}: cannot tell the adapter from model_type {model_type!r}; set model.adapter "
                         f"to one of {('tiny',) + ADAPTERS}")
    return _MODEL_TYPES[model_type]


def load_policy(model: str | Path | ModelConfig, *, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, trainable: bool = False, check_attention: bool | None = None):
    """Load a policy: a stabledrl tiny model, a real checkpoint through its adapter, or
    either with LoRA adapters (a directory holding ``adapter_config.json``, as a LoRA run
    saves; `trainable` keeps the adapters trainable). A weights file that cannot be read
    (cut off, or not safetensors) is a ValueError naming it. `check_attention`: probe a
    full-attention checkpoint's attention at load (`stabledrl.models.adapters.probe_attention`);
    None: the config's ``check_attention`` (on for a path)."""
    cfg = model if isinstance(model, ModelConfig) else ModelConfig(path=str(model))
    if check_attention is not None:
        cfg = dataclasses.replace(cfg, check_attention=check_attention)
    try:
        return _load_policy(cfg, device=device, dtype=dtype, trainable=trainable)
    except SafetensorError as e:
        path = Path(cfg.path)
        names = ", ".join(str(f) for f in _unreadable_weights(path)) or f"a weights file of {path}"
        raise ValueError(f"{names} cannot be read ({e}): it is cut off or not a safetensors file; "
                         "save or download the model again") from None


def _unreadable_weights(path: Path) -> list[Path]:
    """The .safetensors files of a model directory (and of its LoRA base) that do not open."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        files += sorted(Path(base).glob("*.safetensors")) if base and Path(base).is_dir() else []
    bad = []
    for f in files:
        try:
            with safe_open(f, "pt"):
                pass
        except SafetensorError:
            bad.append(f)
    return bad


def _load_policy(cfg: ModelConfig, *, device: str | torch.device | None, dtype: torch.dtype | None,
                 trainable: bool):
    device = cfg.device if device is None else device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = _DTYPES[cfg.dtype] if dtype is None else dtype
    path = Path(cfg.path)
    if (path / "adapter_config.json").is_file():  # LoRA: load the base, then the adapters
        from peft import PeftModel

        policy = _load_policy(_lora_base(path, cfg), device=device, dtype=dtype, trainable=False)
        policy.model = PeftModel.from_pretrained(policy.model, str(path), is_trainable=trainable).to(device)
        return policy
    adapter = resolve_adapter(path, cfg.adapter)
    chat_template = None if cfg.chat_template == "auto" else cfg.chat_template
    if adapter == "tiny":
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a saved model directory (no config.json)")
        tiny = TinyDiffusionLM.from_pretrained(path, dtype=dtype).to(device)
        tiny.eval()
        tiny.gradient_checkpointing = cfg.gradient_checkpointing
        _record_base_path(tiny, path)
        return TinyPolicy(tiny, PreTrainedTokenizerFast.from_pretrained(path), chat_template=chat_template,
                          stop_tokens=tuple(cfg.stop_tokens))
    policy = load_hf_policy(cfg, adapter, dtype=dtype, device=device)
    if path.exists():
        _record_base_path(policy.model, path)
    return policy


def _record_base_path(model: PreTrainedModel, path: Path) -> None:
    """An absolute path, so that LoRA adapters saved from this model find their base again."""
    model.name_or_path = model.config.name_or_path = str(path.resolve())


def _lora_base(path: Path, cfg: ModelConfig) -> ModelConfig:
    """The base model of a saved LoRA policy, with the adapter settings it was saved with."""
    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/adapter_config.json does not name its base model")
    saved = json.loads((path / ADAPTER_FILE).read_text()) if (path / ADAPTER_FILE).is_file() else {}
    pick = lambda name, default: getattr(cfg, name) if getattr(cfg, name) not in (None, default) else saved.get(name, getattr(cfg, name))  # noqa: E731
    return dataclasses.replace(cfg, path=base, adapter=pick("adapter", "auto"), mask_token_id=pick("mask_token_id", None),
                               block_size=pick("block_size", None), shift_logits=pick("shift_logits", None),
                               trust_remote_code=pick("trust_remote_code", None),
                               chat_template=pick("chat_template", "auto"), stop_tokens=pick("stop_tokens", []),
                               prompt_attention=pick("prompt_attention", "auto") or "auto")
