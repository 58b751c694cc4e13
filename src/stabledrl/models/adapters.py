"""Adapters that put real `transformers` checkpoints behind the policy interface (docs/methods.md, "Policy interface").

Every adapter answers ``logits(input_ids, attention_mask, position_ids)`` with
``logits[:, i]`` predicting token ``i``, whatever the checkpoint does natively:

- ``llada`` — LLaDA (Nie et al. 2025): ``AutoModel`` with ``trust_remote_code``. A
  bidirectional masked-diffusion model with unshifted logits. Its forward takes a
  (B, T) padding mask and no position ids (it counts positions itself, as its own
  sampler does), so left padding shifts its positions: a property of the checkpoint.
  Its mask token is 126336, which the tokenizer does not declare: set ``mask_token_id``.
- ``dream`` — Dream (Ye et al. 2025): ``AutoModel`` with ``trust_remote_code``. Initialised
  from an autoregressive model, it keeps the AR head's shift: its ``logits[:, i]``
  predict token ``i + 1``. The adapter undoes it, ``out[:, i] = native[:, i − 1]``; the
  first column has no prediction and repeats ``native[:, 0]`` (it is always a prompt
  token, never scored). It takes a 4-D boolean mask and position ids. Mask token 151666.
- ``masked_lm`` — any ``AutoModelForMaskedLM`` (BERT, RoBERTa, ModernBERT ...) used as a
  masked diffusion model (unshifted logits, the tokenizer's ``[MASK]``).
- ``decoder`` — a causal decoder (Llama / Qwen family, ``AutoModelForCausalLM``) used as a
  block-diffusion model, SDAR style, or SDAR / TraDo themselves (their own code: set
  ``trust_remote_code``, or keep the checkpoint's ``auto_map``, which turns it on). Every
  call brings a boolean (B, T, T) block mask (block-causal for sampling, the staircase for
  the likelihood) that is passed on as a 4-D boolean mask, True where a query may attend:
  what SDPA reads, and what SDAR's own attention expects (it calls ``attention_mask.bool()``
  in eval mode, which would invert an additive 0/−inf mask). Only a model loaded with
  ``attn_implementation="eager"``, which adds its mask to the scores, gets the additive form.
  Its logits are read unshifted by default (position i predicts token i, as SDAR's sampler
  reads them); ``shift_logits: true`` reads them as next-token logits. SDAR's tokenizer has
  no BOS (prompts then start without one). Its blocks are SDAR's by default
  (``prompt_attention: sequence_blocks``: blocks of S over the whole sequence from its first
  token, the prompt's tail sharing the first completion block, as SDAR's sampler and SFT and
  TraDo's rollouts have them); ``model.prompt_attention`` names another convention
  (`stabledrl.models.attention` lists them, with where each was read).

A completion ends at the first of the model's stop tokens (``stop_token_ids``): the
tokenizer's EOS, the EOS ids of the checkpoint's generation config (SDAR-Chat and Dream
name their end-of-turn ``<|im_end|>`` there, as their samplers read it) and those named in
``model.stop_tokens`` (LLaDA-Instruct's ``<|eot_id|>`` is in neither); the sampler never
bans them. Prompts are wrapped in the tokenizer's chat template when it has one
(``chat_template``, `stabledrl.models.prompting`). Both settings are saved with the policy.

``gradient_checkpointing`` (`ModelConfig.gradient_checkpointing`) switches on the model's
own activation checkpointing: LLaDA's ``set_activation_checkpointing("whole_layer")`` (its
remote code; its class declares no transformers support), else transformers'
``gradient_checkpointing_enable()`` (non-reentrant), whose layers checkpoint only in train
mode: while a forward with gradients runs, `stabledrl._compat.checkpointing_in_eval_mode`
marks the modules that gate it as training (themselves only, no dropout). A model with
neither is refused at load.

``trust_remote_code`` (the checkpoint's own modelling code) is on for llada and dream, and
for any local checkpoint whose config.json names its code (``auto_map``); a saved policy
records it, so that a run's final model loads again. Workarounds for that code (SDAR's
``LossKwargs`` import, Dream's generation config at save time) are in `stabledrl._compat`.

**The attention each full-attention adapter relies on is checked at load** (`probe_attention`):
copies of one modelling file in circulation differ (LLaDA's Hub copy attends to padding, the
StableDRL authors' and dLLM-RL's turn a (B, T) mask holding a 0 into a causal bias; dLLM-RL's
Dream casts a boolean mask to 0/1). The adapters pass padding in the one form every copy that
reads masks honours (LLaDA: a boolean ``attention_bias``; Dream: an additive float mask) and
refuse, in one line naming the file, a model that is not bidirectional or lets padding in.

The mask token id is required: from `ModelConfig.mask_token_id`, else the checkpoint's
config, else the tokenizer. Missing, or equal to the pad id, is an error at start-up.

Shapes: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from stabledrl import _compat
from stabledrl.models.attention import PromptAttention, check_prompt_attention
from stabledrl.models.prompting import resolve_chat_template, resolve_stop_tokens

__all__ = ["ADAPTERS", "HFPolicy", "load_hf_policy", "ADAPTER_FILE", "probe_attention"]

log = logging.getLogger(__name__)

ADAPTERS = ("llada", "dream", "masked_lm", "decoder")
ADAPTER_FILE = "stabledrl_adapter.json"
"""Written beside a saved adapter policy so that ``adapter: auto`` finds it again."""

# Mask ids of the public checkpoints, only to make the start-up error actionable.
_KNOWN_MASK_IDS = {"llada": 126336, "dream": 151666}


@dataclass
class HFPolicy:
    """A `transformers` model behind the policy interface (module docstring)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    adapter: Literal["llada", "dream", "masked_lm", "decoder"]
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
        self.stop_token_ids = tuple(dict.fromkeys(named + self.stop_tokens))
        if self.mask_token_id in self.stop_token_ids:
            raise ValueError(f"mask_token_id {self.mask_token_id} is one of the stop tokens {self.stop_token_ids}")
        if self.mask_token_id == self.pad_token_id:
            raise ValueError(f"mask_token_id {self.mask_token_id} equals pad_token_id: they must differ")
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the model's vocabulary of {vocab}")
        self._dtype = self.model.get_input_embeddings().weight.dtype  # before any DDP/FSDP wrapping
        self._additive_mask = getattr(self.model.config, "_attn_implementation", None) == "eager"
        # RoBERTa-style embeddings count positions from padding_idx + 1, BERT's from 0.
        embeddings = getattr(getattr(self.model, "base_model", None), "embeddings", None)
        pad_idx = getattr(embeddings, "padding_idx", None)
        self._position_offset = pad_idx + 1 if isinstance(pad_idx, int) else 0
        if self.gradient_checkpointing:
            self.checkpointing_hook = _enable_checkpointing(self.model)
        if self.adapter == "decoder":
            if not (self.block_size and self.block_size > 0):
                raise ValueError("the decoder adapter is a block-diffusion model: set model.block_size (e.g. 4)")
            self.attention_kind = "block"
            self.prompt_attention = self.prompt_attention or "sequence_blocks"
            check_prompt_attention(self.prompt_attention)
        else:
            if self.block_size is not None:
                raise ValueError(f"model.block_size is for the decoder adapter; {self.adapter} models use full attention")
            if self.prompt_attention not in (None, "bidirectional"):
                raise ValueError(f"model.prompt_attention is for block models (the decoder adapter); {self.adapter} "
                                 "models use full attention")
            self.attention_kind = "full"
            self.prompt_attention = "bidirectional"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, V) logits; logits[:, i] predicts token i."""
        B, T = input_ids.shape
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
        kwargs: dict[str, Any]
        padded = attention_mask.dim() == 2 and not bool(attention_mask.bool().all())
        if self.adapter == "llada":
            # Never the (B, T) mask: the authors' copies turn a mask holding a 0 into a causal bias.
            # A given attention_bias is used as is by every copy that reads masks at all.
            keys = attention_mask.bool()[:, None, None, :].expand(B, 1, T, T)  # (B, 1, T, T) key padding
            kwargs = {"attention_bias": keys} if padded else {}
        elif self.adapter == "masked_lm":
            kwargs = {"attention_mask": attention_mask, "position_ids": position_ids + self._position_offset}
        elif self.adapter == "dream":
            # Additive, in the model's dtype: some copies cast the mask to the query dtype, which
            # would turn a boolean one into 0/1 and mask nothing.
            keys = attention_mask.bool()[:, None, None, :].expand(B, 1, T, T)  # (B, 1, T, T) key padding
            additive = torch.zeros(keys.shape, dtype=self._dtype, device=input_ids.device)
            kwargs = {"attention_mask": additive.masked_fill(~keys, torch.finfo(self._dtype).min),
                      "position_ids": position_ids}
        else:  # decoder: the block mask as a 4-D boolean mask, True = may attend
            allowed = attention_mask.bool()[:, None]  # (B, 1, T, T)
            # Every query keeps itself, so padding rows are finite (and never read).
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=input_ids.device)
            if self._additive_mask:  # eager attention adds the mask to its scores
                additive = torch.zeros(allowed.shape, dtype=self._dtype, device=input_ids.device)
                allowed = additive.masked_fill(~allowed, torch.finfo(self._dtype).min)
            kwargs = {"attention_mask": allowed, "position_ids": position_ids}
        if self.adapter != "masked_lm":
            kwargs["use_cache"] = False  # decoders would otherwise build a KV cache per call
        eval_mode_checkpointing = self.checkpointing_hook == "gradient_checkpointing_enable" and torch.is_grad_enabled()
        with _compat.checkpointing_in_eval_mode(self.model) if eval_mode_checkpointing else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, **kwargs).logits  # (B, T, V)
        if self.shift_logits:  # native[:, i] predicts token i+1: move it to column i+1
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out

    def save(self, path: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`state_dict`: the weights to write instead of the model's own (the full weights
        gathered from sharded processes)."""
        path = Path(path)
        _compat.save_pretrained(self.model, path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        (path / ADAPTER_FILE).write_text(json.dumps(
            {"adapter": self.adapter, "mask_token_id": self.mask_token_id, "block_size": self.block_size,
             "shift_logits": self.shift_logits, "trust_remote_code": self.trust_remote_code,
             "chat_template": self.chat_template, "stop_tokens": list(self.stop_tokens),
             "prompt_attention": self.prompt_attention if self.attention_kind == "block" else None},
            indent=2) + "\n")


def probe_attention(logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, vocab: int,
                    avoid: Sequence[int], source: str, device: str | torch.device = "cpu") -> None:
    """Refuse a full-attention model, in one line naming `source`, unless (1) an early position
    depends on a later token and (2) a left-padded row's real positions do not depend on its
    padded ones. Two rows of 6 tokens (the second with 2 padded), called twice: the second
    call changes row 0's last token and row 1's padded tokens. (2) skips the first real
    position, which a shifted model (Dream) reads from the padded one before it. Where a token
    is not attended to, the logits do not change at all (masked keys weigh exactly 0), so both
    checks compare at 1e-5 of the logits' scale."""
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
    tol = 1e-5 * float(a.abs().max())
    if float((a[0, 0] - b[0, 0]).abs().max()) <= tol:
        raise ValueError(f"{source}: position 0 does not depend on a later token, so the model attends causally "
                         "where this adapter needs full attention; use a bidirectional copy of the modelling file, "
                         "or load a causal model with the decoder adapter")
    if float((a[1, 3:] - b[1, 3:]).abs().max()) > tol:
        raise ValueError(f"{source}: a left-padded row's logits change with its padding tokens, so this modelling "
                         "file attends to padding (LLaDA's Hub copy drops its attention mask); replace it with a "
                         "copy that applies its attention bias (docs/scale-out.md, 'Attention probe')")


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


def load_hf_policy(
    path: str | Path,
    adapter: str,
    *,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    shift_logits: bool | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool | None = None,
    chat_template: bool | None = None,
    stop_tokens: Sequence[int | str] = (),
    prompt_attention: str | None = None,
    gradient_checkpointing: bool = False,
    check_attention: bool = True,
) -> HFPolicy:
    """Load a checkpoint (a local directory or a Hub name) with the named adapter. A policy
    saved by stabledrl keeps the settings it was saved with unless they are given here
    (`chat_template`, `prompt_attention` None and `stop_tokens` empty take the saved ones).
    `check_attention`: probe a full-attention model's attention (`probe_attention`)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, got {adapter!r}")
    auto = {"llada": AutoModel, "dream": AutoModel, "masked_lm": AutoModelForMaskedLM,
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
    remote = (adapter in ("llada", "dream") or _names_its_code(path)) if trust_remote_code is None else trust_remote_code
    if remote:
        _compat.check_remote_code_supported(adapter)
        _compat.install_remote_code_shims()
    model = auto.from_pretrained(str(path), dtype=dtype, trust_remote_code=remote).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=remote)
    mask_id = _resolve_mask_id(adapter, mask_token_id, model, tokenizer)
    if adapter == "decoder" and block_size is None:  # SDAR / TraDo name their block size
        block_size = getattr(model.config, "block_size", None)
    shift = (adapter == "dream") if shift_logits is None else shift_logits
    _compat.fit_no_split_modules(model)
    policy = HFPolicy(model, tokenizer, adapter, mask_id, block_size=block_size, shift_logits=shift,
                      trust_remote_code=remote, chat_template=chat_template, stop_tokens=tuple(stop_tokens),
                      prompt_attention=prompt_attention, gradient_checkpointing=gradient_checkpointing)
    if check_attention and policy.attention_kind == "full" and _compat.weights_loaded_here():
        code = type(model).__module__.rsplit(".", 1)[-1] + ".py" if remote else type(model).__name__
        with _compat.gathered_parameters(model):  # partitioned where ZeRO-3 loaded it
            probe_attention(policy.logits, vocab=model.get_input_embeddings().num_embeddings, device=device,
                            avoid=(policy.pad_token_id, policy.mask_token_id, *policy.stop_token_ids),
                            source=f"{Path(str(path)) / code if remote else code} ({adapter} adapter)")
    return policy
