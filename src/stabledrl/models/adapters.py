"""Adapters that put real `transformers` checkpoints behind the policy interface.

Every adapter answers ``logits(input_ids, attention_mask, position_ids)`` with
``logits[:, i]`` predicting token ``i`` (docs/methods.md, "Policy interface"):

- ``llada``, ``dream``, ``sdar``: stabledrl's own code of the family (`stabledrl.models.native`),
  one forward per batch, with a `KVCache` (`HFPolicy.new_cache`); Dream's logits moved back by one.
- the same on their published code (``trust_remote_code: true``): ``llada`` never sees padding
  (rows of equal left padding run together, no mask: `_llada_logits`); ``dream`` takes an
  additive mask in the model's dtype, with position ids; ``sdar`` is read as ``decoder`` is.
- ``masked_lm``: any ``AutoModelForMaskedLM``; ``decoder``: a causal decoder read as a
  block-diffusion model (SDAR / TraDo's published code included), given a boolean block mask;
  with a KV cache (`HFPolicy.new_cache`) where its code takes SDAR's ``store_kv``.

The attention each full-attention adapter relies on is checked at load (`probe_attention`).
docs/scale-out.md ("Adapters in detail", "Attention probe") says what each adapter passes
and why, and how stop tokens, chat templates, checkpointing and remote code are resolved.

Shapes: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from stabledrl import _compat
from stabledrl.data import completion_stop_ids
from stabledrl.models.attention import PromptAttention, check_prompt_attention
from stabledrl.models.native import NATIVE_MODELS
from stabledrl.models.tiny import KVCache
from stabledrl.models.prompting import resolve_chat_template, resolve_stop_tokens
from stabledrl.settings import ModelConfig

__all__ = ["ADAPTERS", "HFPolicy", "load_hf_policy", "ADAPTER_FILE", "probe_attention"]

log = logging.getLogger(__name__)

ADAPTERS = ("llada", "dream", "sdar", "masked_lm", "decoder")
ADAPTER_FILE = "stabledrl_adapter.json"
"""Written beside a saved adapter policy so that ``adapter: auto`` finds it again."""

# Mask ids of the public checkpoints, only to make the start-up error actionable.
_KNOWN_MASK_IDS = {"llada": 126336, "dream": 151666, "sdar": 151669}


@dataclass
class HFPolicy:
    """A `transformers` model behind the policy interface (module docstring)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    adapter: Literal["llada", "dream", "sdar", "masked_lm", "decoder"]
    mask_token_id: int
    block_size: int | None = None
    shift_logits: bool = False
    """True when the model's logits[:, i] predict token i + 1 (Dream; a decoder read AR style)."""
    trust_remote_code: bool = False
    """The model runs its checkpoint's own code; saved with the policy so that it loads again."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None: when it has one (resolved at construction)."""
    stop_tokens: tuple[int | str, ...] = ()
    """More stop tokens, by id or text (resolved to ids at construction)."""
    prompt_attention: PromptAttention | None = None
    """decoder: where the prompt's blocks fall (`stabledrl.models.attention`); None: sequence_blocks
    (SDAR's). Full-attention adapters: bidirectional (the prompt and completion see each other)."""
    gradient_checkpointing: bool = False
    """Recompute each layer in the backward, through the model's own hook (module docstring)."""
    checkpointing_hook: Literal["set_activation_checkpointing", "gradient_checkpointing_enable"] | None = field(
        init=False, default=None)
    """The hook that `gradient_checkpointing` switched on."""
    pad_token_id: int = field(init=False)
    eos_token_id: int = field(init=False)
    stop_token_ids: tuple[int, ...] = field(init=False)
    """Tokens that end a completion: EOS first, then the generation config's EOS ids, then `stop_tokens`."""
    attention_kind: Literal["full", "block"] = field(init=False)
    native: bool = field(init=False)
    """The model is stabledrl's own code of its family (`stabledrl.models.native`)."""

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; completions could never end")
        if tok.pad_token_id is None:
            # The common convention for decoders without a pad token; the completion mask
            # stops at the first EOS, so pad == eos changes nothing that is scored.
            log.warning("the tokenizer has no PAD token; using EOS (%s) as PAD", tok.eos_token)
            tok.pad_token = tok.eos_token
        self.pad_token_id = int(tok.pad_token_id)
        self.eos_token_id = int(tok.eos_token_id)
        vocab = self.model.get_input_embeddings().num_embeddings
        self.chat_template = resolve_chat_template(tok, self.chat_template)
        self.stop_tokens = resolve_stop_tokens(tok, self.stop_tokens, vocab)
        named = _stop_ids(self.eos_token_id, getattr(self.model, "generation_config", None))
        self.stop_token_ids = completion_stop_ids(tok, named + self.stop_tokens)
        if self.mask_token_id == self.pad_token_id:
            raise ValueError(f"mask_token_id {self.mask_token_id} equals pad_token_id: they must differ")
        if self.mask_token_id in self.stop_token_ids:
            raise ValueError(f"mask_token_id {self.mask_token_id} is one of the stop tokens {self.stop_token_ids}")
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the model's vocabulary of {vocab}")
        self.native = type(self.model) in NATIVE_MODELS.values()
        self._dtype = self.model.get_input_embeddings().weight.dtype  # before any DDP/FSDP wrapping
        self._additive_mask = getattr(self.model.config, "_attn_implementation", None) == "eager"
        block = self.adapter in ("decoder", "sdar")
        self._store_kv = block and not self.native and any(
            "store_kv" in inspect.signature(m.forward).parameters for m in self.model.modules())
        # RoBERTa-style embeddings count positions from padding_idx + 1, BERT's from 0.
        embeddings = getattr(getattr(self.model, "base_model", None), "embeddings", None)
        pad_idx = getattr(embeddings, "padding_idx", None)
        self._position_offset = pad_idx + 1 if isinstance(pad_idx, int) else 0
        if self.gradient_checkpointing and self.native:
            self.model.gradient_checkpointing = True  # its own flag, in eval mode too
        elif self.gradient_checkpointing:
            self.checkpointing_hook = _enable_checkpointing(self.model)
        if block:
            if not (self.block_size and self.block_size > 0):
                raise ValueError(f"the {self.adapter} adapter is a block-diffusion model: set model.block_size (e.g. 4)")
            self.attention_kind = "block"
            self.prompt_attention = self.prompt_attention or "sequence_blocks"
            check_prompt_attention(self.prompt_attention)
        else:
            if self.block_size is not None:
                raise ValueError(f"model.block_size is for block models (decoder, sdar); {self.adapter} models use "
                                 "full attention")
            if self.prompt_attention not in (None, "bidirectional"):
                raise ValueError(f"model.prompt_attention is for block models (decoder, sdar); {self.adapter} "
                                 "models use full attention")
            self.attention_kind = "full"
            self.prompt_attention = "bidirectional"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def new_cache(self) -> Callable[[], Any]:
        """Makes an empty KV cache: a `KVCache` for the native models (the block sampler's exact
        cache of SDAR; Fast-dLLM's approximate caches of LLaDA and Dream), transformers'
        `DynamicCache` for a decoder whose published code can attend to cached keys without
        storing the new ones (SDAR's and TraDo's `store_kv`). Absent (AttributeError) for
        every other model, so that the sampler recomputes the prefix."""
        if self.native:
            return KVCache
        if not self._store_kv:
            raise AttributeError(f"{type(self.model).__name__} takes no store_kv: no KV cache through this adapter")
        from transformers import DynamicCache

        return DynamicCache

    @property
    def cache_in_place(self) -> bool:
        """The model writes a `KVCache` in place where it says (`KVCache.write_at`): the native models."""
        return self.native

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: Any = None,
        extend_cache: bool = False,
        columns: slice | None = None,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, V) logits; logits[:, i] predicts token i. With `cache` (from
        `new_cache`; a (B, T, Tc + T) mask, cached keys first) the tokens also attend to the
        cached ones, and `extend_cache` appends theirs to it. `columns`: (B, W, V), those
        columns' logits only (the native models run their head on them alone)."""
        if cache is not None and not (self._store_kv or self.native):
            raise ValueError(f"the {self.adapter} adapter of {type(self.model).__name__} keeps no KV cache")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.attention_kind == "block" and attention_mask.dim() == 2:
            raise ValueError("a block-diffusion policy needs a boolean (B, T, T) attention mask "
                             "(stabledrl.models.attention builds them)")
        if attention_mask.dim() == 3 and self.attention_kind == "full":
            raise ValueError(f"the {self.adapter} adapter is full-attention; pass a (B, T) padding mask")
        if position_ids is None:
            if attention_mask.dim() != 2:
                raise ValueError("position_ids are required with a boolean (B, T, T) mask")
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.native:
            return self._native_logits(input_ids, attention_mask, position_ids, cache, extend_cache, columns)
        return self._published_logits(input_ids, attention_mask, position_ids, cache, extend_cache)[:, columns or slice(None)]

    def _published_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                          cache: Any, extend_cache: bool) -> torch.Tensor:
        """`logits` through a published modelling file or transformers' own model class."""
        B, T = input_ids.shape
        kwargs: dict[str, Any]
        if self.adapter == "llada":
            out = self._llada_logits(input_ids, attention_mask)  # (B, T, V)
            return _unshift(out) if self.shift_logits else out
        if self.adapter == "masked_lm":
            kwargs = {"attention_mask": attention_mask, "position_ids": position_ids + self._position_offset}
        elif self.adapter == "dream":
            # Additive, in the model's dtype: some copies cast the mask to the query dtype, which
            # would turn a boolean one into 0/1 and mask nothing.
            keys = attention_mask.bool()[:, None, None, :].expand(B, 1, T, T)  # (B, 1, T, T) key padding
            kwargs = {"attention_mask": _additive(keys, self._dtype), "position_ids": position_ids}
        else:  # decoder: the block mask as a 4-D boolean mask, True = may attend
            allowed = attention_mask.bool()[:, None]  # (B, 1, T, Tk): Tk = Tc cached keys + T
            Tk = allowed.size(-1)
            # Every query keeps itself (its own key, after the cached ones), so padding rows are finite.
            keys = torch.arange(Tk, device=input_ids.device)  # (Tk,)
            allowed = allowed | (keys[None, :] == torch.arange(T, device=input_ids.device)[:, None] + Tk - T)
            if self._additive_mask:  # eager attention adds the mask to its scores
                allowed = _additive(allowed, self._dtype)
            kwargs = {"attention_mask": allowed, "position_ids": position_ids}
        if cache is not None:  # SDAR's store_kv: append these keys, or attend to the cache and store nothing
            kwargs.update(past_key_values=cache, use_cache=True, store_kv=extend_cache)
        elif self.adapter != "masked_lm":
            kwargs["use_cache"] = False  # decoders would otherwise build a KV cache per call
        out = self._forward(input_ids, **kwargs)  # (B, T, V)
        return _unshift(out) if self.shift_logits else out

    def _native_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                       cache: KVCache | None, extend_cache: bool, columns: slice | None = None) -> torch.Tensor:
        """One forward of the native model, whatever the padding (module docstring); `columns`:
        the head runs on those columns only (under Dream's shift, on the ones before them)."""
        def run(keep: slice | None) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=cache, extend_cache=extend_cache, logits_columns=keep).logits

        if not self.shift_logits:
            return run(columns)
        if columns is not None and (columns.start or 0) >= 1:  # column i - 1 predicts token i
            return run(slice(columns.start - 1, -1 if columns.stop is None else columns.stop - 1))
        out = _unshift(run(None))  # (B, T, V)
        return out if columns is None else out[:, columns]

    def _forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The model's own logits, with transformers' checkpointing kept on in eval mode."""
        eval_mode_checkpointing = self.checkpointing_hook == "gradient_checkpointing_enable" and torch.is_grad_enabled()
        with _compat.checkpointing_in_eval_mode(self.model) if eval_mode_checkpointing else contextlib.nullcontext():
            return self.model(input_ids=input_ids, **kwargs).logits

    def _llada_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) left-padded rows -> (B, T, V), the model never given padding nor a mask: copies
        of its file ignore a mask, honour it or turn it causal (docs/scale-out.md). Rows with the
        same number of padding columns run together on their real columns; RoPE scores depend
        only on position differences, so a common left offset dropped changes nothing. Padding
        columns get zeros (never read). One forward per distinct padding count."""
        B, T = input_ids.shape
        real = attention_mask.bool()  # (B, T)
        pads = T - real.sum(dim=1)  # (B,) padding columns per row
        if not torch.equal(real, torch.arange(T, device=real.device)[None, :] >= pads[:, None]):
            raise ValueError("the llada adapter takes left-padded rows: a (B, T) mask of zeros, then ones")
        pads = pads.masked_fill(pads == T, 0)  # a row of padding only has nothing to protect
        counts = pads.unique().tolist()  # ascending
        needed = _forwards_everywhere(self.model, len(counts), input_ids.device)
        if counts == [0] and needed == 1:
            return self._forward(input_ids, use_cache=False)  # no padding: the model as it is
        out = None
        for p in counts:
            rows = (pads == p).nonzero().squeeze(1)  # (b,)
            group = self._forward(input_ids[rows, p:], use_cache=False)  # (b, T - p, V)
            out = group.new_zeros(B, T, group.size(-1)) if out is None else out
            out[rows, p:] = group
        for _ in range(needed - len(counts)):  # the forwards other processes make (sharded weights)
            spare = self._forward(input_ids[:1, -1:], use_cache=False)  # (1, 1, V)
            out = out + 0 * spare.sum()  # in the graph at weight 0: its backward, a collective too, runs everywhere
        return out

    def save(self, path: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`state_dict`: the weights to write instead of the model's own (the full weights
        gathered from sharded processes)."""
        path = Path(path)
        _compat.save_pretrained(self.model, path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        source = getattr(getattr(self.model, "config", None), "_name_or_path", "")
        if self.native and source and Path(source).resolve() != path.resolve() and (path / "config.json").is_file():
            _keep_published_files(path, source, getattr(self.model, "generation_config", None))
        (path / ADAPTER_FILE).write_text(json.dumps(
            {"adapter": self.adapter, "mask_token_id": self.mask_token_id, "block_size": self.block_size,
             "shift_logits": self.shift_logits, "trust_remote_code": self.trust_remote_code,
             "chat_template": self.chat_template, "stop_tokens": list(self.stop_tokens),
             "prompt_attention": self.prompt_attention if self.attention_kind == "block" else None},
            indent=2) + "\n")


def probe_attention(logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, vocab: int,
                    avoid: Sequence[int], source: str, device: str | torch.device = "cpu") -> None:
    """Refuse a full-attention model, in one line naming `source`, unless (1) an early position
    depends on a later token, (2) a left-padded row's real positions do not depend on its padded
    ones and (3) equal that row's logits run alone, unpadded. Two rows of 6 tokens (the second
    with 2 padded), called twice: the second call changes row 0's last token and row 1's padded
    tokens; then row 1's 4 real tokens alone. (2) and (3) skip the first real position, which a
    shifted model (Dream) reads from the padded one before it. Where a token is not attended
    to, the logits do not change at all (masked keys weigh exactly 0), so the checks compare at
    1e-5 of the logits' scale (rounding of other shapes stays far below)."""
    tokens = [i for i in range(min(vocab, 64)) if i not in set(avoid)]
    if len(tokens) < 9:
        return  # a vocabulary this small is a test's; nothing to probe with
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], device=device)  # (2, 6)
    first = torch.tensor([tokens[:6], tokens[:6]], device=device)  # (2, 6)
    second = first.clone()
    second[0, -1] = tokens[6]  # a later token of the unpadded row
    second[1, :2] = torch.tensor(tokens[7:9], device=device)  # the padded row's padding
    with torch.no_grad():
        a, b = (logits(ids, mask).float() for ids in (first, second))  # (2, 6, V) each
        alone = logits(first[1:, 2:], mask[:1, 2:]).float()  # (1, 4, V): row 1's real tokens
    tol = 1e-5 * float(a.abs().max())
    if float((a[0, 0] - b[0, 0]).abs().max()) <= tol:
        raise ValueError(f"{source}: position 0 does not depend on a later token, so the model attends causally "
                         "where this adapter needs full attention; use a bidirectional copy of the modelling file, "
                         "or load a causal model with the decoder adapter")
    if float((a[1, 3:] - b[1, 3:]).abs().max()) > tol:
        raise ValueError(f"{source}: a left-padded row's logits change with its padding tokens, so this modelling "
                         "file attends to padding as the adapter calls it; use a copy that applies its attention "
                         "mask (docs/scale-out.md, 'Attention probe')")
    if float((a[1, 3:] - alone[0, 1:]).abs().max()) > tol:
        raise ValueError(f"{source}: a left-padded row's logits differ from the same row run alone, so the model "
                         "reads positions otherwise than this adapter passes them (docs/scale-out.md, 'Attention "
                         "probe')")


def _unshift(out: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits whose column i predicts token i + 1 -> column i predicting token i (column 0
    repeats column 0: a prompt token, never scored)."""
    return torch.cat([out[:, :1], out[:, :-1]], dim=1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as the additive one eager attention adds to its scores,
    in `dtype`: 0 where allowed, the dtype's lowest value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _forwards_everywhere(model: Any, n: int, device: torch.device) -> int:
    """The most forwards any process makes in this call (`n` here) where every forward is a
    collective (FSDP, DeepSpeed: parameters gathered per forward), else `n`."""
    import torch.distributed as dist

    sharded = {c.__name__ for c in type(model).__mro__} & _compat.SHARDING_CLASSES
    if not (sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n
    most = torch.tensor([n], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def _enable_checkpointing(model: PreTrainedModel) -> str:
    """Switch on the model's own activation checkpointing; returns the hook used."""
    inner = getattr(model, "model", None)
    if callable(getattr(inner, "set_activation_checkpointing", None)):  # LLaDA's remote code, in eval mode too
        inner.set_activation_checkpointing("whole_layer")  # its ActivationCheckpointingStrategy is a str enum
        return "set_activation_checkpointing"
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "gradient_checkpointing_enable"
    raise ValueError(f"model.gradient_checkpointing: {type(model).__name__} supports neither transformers' "
                     "gradient_checkpointing_enable() (supports_gradient_checkpointing) nor LLaDA's "
                     "set_activation_checkpointing(); set model.gradient_checkpointing: false")


def _stop_ids(eos: int, generation_config: Any) -> tuple[int, ...]:
    """EOS, then the other EOS ids the generation config names (an int or a list there)."""
    named = getattr(generation_config, "eos_token_id", None)
    named = [] if named is None else [named] if isinstance(named, int) else list(named)
    return tuple(dict.fromkeys([eos, *(int(i) for i in named)]))


def _names_its_code(path: str | Path) -> bool:
    """A local checkpoint whose config.json maps the Auto classes to its own modelling files."""
    config = Path(path) / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("auto_map"))
    except (OSError, ValueError):
        return False


def _load_tokenizer(path: str | Path, remote: bool, native: bool, config: Any) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; under the native code its own tokenizer file only where the
    tokenizer needs one (Dream's names its class there), not the model's code. The model's
    `config` spares transformers reading config.json again with a class that is not the family's."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=remote, **({"config": config} if native else {}))
    except ValueError as e:
        if remote or not native or "trust_remote_code" not in str(e):
            raise
        log.info("%s: its tokenizer is defined in its own file; loading it with trust_remote_code", path)
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=True, config=config)


def _generation_config(path: str | Path) -> Any:
    """The checkpoint's generation_config.json as a plain `GenerationConfig` (a family's own
    fields, Dream's ``alg`` and ``steps``, kept as attributes), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except OSError:
        return None


def _model_type(path: str | Path) -> str | None:
    """A local checkpoint's model_type, lowercased (Dream's is "Dream"); None for a Hub name."""
    config = Path(path) / "config.json"
    return str(json.loads(config.read_text()).get("model_type", "")).lower() if config.is_file() else None


def _check_family(path: str | Path, adapter: str) -> None:
    """A local checkpoint of another family than `adapter` is refused in one line."""
    config = Path(path) / "config.json"
    model_type = _model_type(path)
    if model_type is not None and model_type != adapter:  # each family's model_type, lowercased, is its adapter
        raise ValueError(f"{config}: model_type {model_type!r} is not a {adapter} checkpoint; set model.adapter to "
                         "the checkpoint's family (auto reads it), or model.trust_remote_code: true to run its own code")


def _keep_published_files(path: Path, source: str, generation_config: Any) -> None:
    """What a native checkpoint saved in `path` keeps of the one it was loaded from, `source`: its
    generation_config.json as written (a family's own fields, which transformers' class drops on a
    round trip), and an ``auto_map`` that still finds its published modelling files, so that the
    published code loads it too: copied from a local `source` directory, or named in `source`'s
    Hub repository (transformers' ``repo--module.Class``)."""
    src, config_file = Path(source), path / "config.json"
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", path / "generation_config.json")
    elif generation_config is not None:
        generation_config.save_pretrained(path)
    config = json.loads(config_file.read_text())
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    for key, ref in auto_map.items():
        if not isinstance(ref, str) or "--" in ref:
            continue
        module_file = src / (ref.rsplit(".", 1)[0] + ".py")
        if module_file.is_file():
            shutil.copy2(module_file, config_file.parent / module_file.name)
        elif not src.exists():
            auto_map[key] = f"{source}--{ref}"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _resolve_mask_id(adapter: str, explicit: int | None, model: PreTrainedModel, tokenizer) -> int:
    for source, value in (("model.mask_token_id", explicit),
                          ("the checkpoint's config", getattr(model.config, "mask_token_id", None)),
                          ("the tokenizer", tokenizer.mask_token_id)):
        if value is not None:
            log.info("mask token id %s from %s", value, source)
            return int(value)
    hint = f" ({adapter} checkpoints use {_KNOWN_MASK_IDS[adapter]})" if adapter in _KNOWN_MASK_IDS else ""
    raise ValueError(f"no mask token id: neither model.mask_token_id, the checkpoint's config nor the tokenizer "
                     f"names one; set model.mask_token_id{hint}")


def load_hf_policy(cfg: ModelConfig, adapter: str, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> HFPolicy:
    """Load `cfg.path` (a local directory or a Hub name) with the named adapter (`cfg.adapter`
    may be auto: `adapter` is the resolved one); `cfg.dtype` and `cfg.device` are read by the
    caller, which passes them resolved. A policy saved by stabledrl keeps the settings it was
    saved with unless `cfg` names them (``chat_template`` and ``prompt_attention`` auto and
    ``stop_tokens`` empty take the saved ones). `cfg.check_attention`: probe a full-attention
    model's attention (`probe_attention`)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, got {adapter!r}")
    path, mask_token_id, block_size, shift_logits = cfg.path, cfg.mask_token_id, cfg.block_size, cfg.shift_logits
    trust_remote_code, stop_tokens = cfg.trust_remote_code, tuple(cfg.stop_tokens)
    chat_template = None if cfg.chat_template == "auto" else cfg.chat_template
    prompt_attention = None if cfg.prompt_attention == "auto" else cfg.prompt_attention
    auto = {"llada": AutoModel, "dream": AutoModel, "sdar": AutoModelForCausalLM, "masked_lm": AutoModelForMaskedLM,
            "decoder": AutoModelForCausalLM}[adapter]
    saved = Path(path) / ADAPTER_FILE
    if saved.is_file():  # a policy saved by stabledrl: its settings unless given explicitly
        meta = json.loads(saved.read_text())
        mask_token_id = meta["mask_token_id"] if mask_token_id is None else mask_token_id
        block_size = meta["block_size"] if block_size is None else block_size
        shift_logits = meta["shift_logits"] if shift_logits is None else shift_logits
        trust_remote_code = meta.get("trust_remote_code") if trust_remote_code is None else trust_remote_code
        chat_template = meta.get("chat_template") if chat_template is None else chat_template
        stop_tokens = stop_tokens or meta.get("stop_tokens", ())
        prompt_attention = meta.get("prompt_attention") if prompt_attention is None else prompt_attention
    native = adapter in NATIVE_MODELS and not trust_remote_code
    remote = (not native and _names_its_code(path)) if trust_remote_code is None else trust_remote_code
    if native:
        _check_family(path, adapter)
        model = NATIVE_MODELS[adapter].from_pretrained(str(path), dtype=dtype)
        model.generation_config = _generation_config(path)  # its EOS ids name stop tokens; saved with the model
    else:
        if remote:
            _compat.check_remote_code_supported(_model_type(path) or adapter)
            _compat.install_remote_code_shims()
        model = auto.from_pretrained(str(path), dtype=dtype, trust_remote_code=remote)
    if not _compat.sharded_at_prepare():
        model.to(device)  # under FSDP's sharded load the weights stay on the CPU: `prepare` moves each shard
    model.eval()
    tokenizer = _load_tokenizer(path, remote, native, model.config)
    mask_id = _resolve_mask_id(adapter, mask_token_id, model, tokenizer)
    if adapter in ("decoder", "sdar") and block_size is None:  # SDAR / TraDo name their block size
        block_size = getattr(model.config, "block_size", None)
    shift = (adapter == "dream") if shift_logits is None else shift_logits
    _compat.fit_no_split_modules(model)
    policy = HFPolicy(model, tokenizer, adapter, mask_id, block_size=block_size, shift_logits=shift,
                      trust_remote_code=remote, chat_template=chat_template, stop_tokens=tuple(stop_tokens),
                      prompt_attention=prompt_attention, gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.check_attention and remote and policy.attention_kind == "full" and _compat.weights_loaded_here():
        code = type(model).__module__.rsplit(".", 1)[-1] + ".py" if remote else type(model).__name__
        with _compat.gathered_parameters(model):  # partitioned where ZeRO-3 loaded it
            probe_attention(policy.logits, vocab=model.get_input_embeddings().num_embeddings, device=device,
                            avoid=(policy.pad_token_id, policy.mask_token_id, *policy.stop_token_ids),
                            source=f"{Path(str(path)) / code if remote else code} ({adapter} adapter)")
    return policy
