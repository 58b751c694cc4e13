"""stabledrl's own code for the published diffusion LMs: LLaDA, Dream, SDAR / TraDo.

The same numbers as each family's published modelling file from the same weights (tested,
docs/scale-out.md "Native models"), under the published class, module and parameter names:
checkpoints load as they are, and a saved one loads into the published code again. Unlike
those files, one forward serves a left-padded batch (a (B, T) key-padding mask, or a boolean
(B, T, Tc + T) one, with position ids over each row's real tokens), and a `KVCache` holds the
keys of tokens already processed (SDAR's exact block cache; Fast-dLLM's caches of LLaDA and
Dream, `stabledrl.sampling`). One layer's arithmetic serves all (pre-norm attention with
RoPE, SwiGLU, RMSNorm in float32); the families differ in names, biases and norms:

- LLaDA (``LLaDAModelLM``, ``llada``): ``model.transformer.{wte, blocks.i, ln_f, ff_out}``, a
  block of ``attn_norm, q/k/v_proj, attn_out, ff_norm, ff_proj`` (the gate) ``, up_proj, ff_out``.
- Dream (``DreamModel``, ``Dream``): Qwen2's names, biases on q, k, v; logits[:, i] predict i + 1.
- SDAR / TraDo (``SDARForCausalLM``, ``sdar``): Qwen3's names, RMSNorm over each head's
  queries and keys before RoPE; block diffusion (an explicit boolean mask, always).

Shapes: B batch, T new tokens, Tc cached, D width, H query heads, Hkv key/value heads, Dh head
width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from stabledrl.models.tiny import KVCache, RopeTables, check_write_at, join_cached, rope_frequencies, sdpa_mask

__all__ = ["Architecture", "LLaDAConfig", "DreamConfig", "SDARConfig", "LLaDAModelLM", "DreamModel",
           "SDARForCausalLM", "NATIVE_MODELS", "architecture"]


@dataclass(frozen=True)
class Architecture:
    """What the arithmetic needs, read from a family's config (`architecture`)."""

    vocab_size: int
    """Rows of the embedding and of the output head (LLaDA: its ``embedding_size``)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    eps: float
    qkv_bias: bool
    """Biases on the query, key and value projections (Dream's, Qwen2's)."""
    qk_norm: bool
    """RMSNorm over each head's queries and keys before RoPE (SDAR's, Qwen3's)."""
    tie_embeddings: bool
    """The output head is the embedding matrix (no weights of its own)."""
    norm_weight_in_float32: bool
    """Multiply by the norm's weight before casting back (flash-attn's fused RMSNorm, SDAR's);
    else after (LLaDA's and Qwen2's RMSNorm). The same in float32."""
    rope_in_float32: bool
    """Rotate queries and keys in float32 (LLaDA's ``rope_full_precision``); else in their own
    dtype with cos and sin cast to it (Qwen2's and Qwen3's). The same in float32."""


# ------------------------------------------------------------------------------ configs
class _FamilyConfig(PretrainedConfig):
    """A published family's config.json, every field kept as written (so that a saved
    checkpoint loads into the published code again); `architecture` reads what it needs. Each
    subclass defines its own __init__: transformers 5 would otherwise generate one that skips this."""

    _defaults: ClassVar[dict[str, Any]] = {}
    """The published configuration class's defaults, for a field config.json leaves out."""

    def __init__(self, **kwargs: Any) -> None:
        for name, value in self._defaults.items():
            kwargs.setdefault(name, value)
        # Fields the base class would otherwise drop or rename are set as attributes first.
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in self._defaults}
        for name, value in own.items():
            setattr(self, name, value)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class LLaDAConfig(_FamilyConfig):
    """LLaDA's config.json (its ``LLaDAConfig``: OLMo's field names)."""

    model_type = "llada"
    _defaults = {"d_model": 768, "n_heads": 12, "n_kv_heads": None, "n_layers": 12, "mlp_ratio": 4,
                 "mlp_hidden_size": None, "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1,
                 "alibi": False, "rope": False, "rope_full_precision": True, "multi_query_attention": None,
                 "attention_layer_norm": False, "input_emb_norm": False, "layer_norm_type": "default",
                 "layer_norm_with_affine": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "include_qkv_bias": False,
                 "include_bias": False, "bias_for_layer_norm": None, "scale_logits": False, "clip_qkv": None,
                 "vocab_size": 50257, "embedding_size": 50304, "weight_tying": True}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class DreamConfig(_FamilyConfig):
    """Dream's config.json (Qwen2's field names)."""

    model_type = "Dream"
    _defaults = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "rope_theta": 10000.0,
                 "rope_scaling": None, "rms_norm_eps": 1e-6, "use_sliding_window": False}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class SDARConfig(_FamilyConfig):
    """SDAR's and TraDo's config.json (Qwen3's field names and ``block_size``)."""

    model_type = "sdar"
    _defaults = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
                 "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "attention_bias": False,
                 "use_sliding_window": False, "block_size": 4}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


def _refuse(config: PretrainedConfig, field: str, value: Any, *, allowed: Any) -> None:
    if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
        raise ValueError(f"{type(config).model_type} config.json: {field} = {value!r} is not understood by stabledrl's "
                         f"native {type(config).model_type} (it supports {allowed!r}); load the checkpoint's own code "
                         "with model.trust_remote_code: true")


def _rope_scaling_none(config: PretrainedConfig) -> None:
    scaling = getattr(config, "rope_scaling", None)
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    _refuse(config, "rope_scaling", kind, allowed=(None, "default"))


def architecture(config: PretrainedConfig) -> Architecture:
    """The `Architecture` of a family's config; a ValueError naming the first field whose value
    the native code does not compute (a checkpoint of another shape than the published ones)."""
    c = config
    if isinstance(c, LLaDAConfig):
        # The published file's switches (its configuration_llada.py); each other value changes the arithmetic.
        for field, allowed in (("block_type", "llama"), ("include_bias", False), ("include_qkv_bias", (False, None)),
                               ("layer_norm_type", "rms"), ("layer_norm_with_affine", True),
                               ("bias_for_layer_norm", (None, False)), ("activation_type", "silu"), ("rope", True),
                               ("rope_full_precision", True), ("alibi", False), ("attention_layer_norm", False),
                               ("clip_qkv", None), ("scale_logits", False), ("multi_query_attention", (None, False)),
                               ("input_emb_norm", False), ("block_group_size", 1)):
            _refuse(c, field, getattr(c, field, None), allowed=allowed)
        heads = c.n_heads
        return Architecture(
            vocab_size=c.embedding_size or c.vocab_size, hidden_size=c.d_model, num_layers=c.n_layers,
            num_heads=heads, num_kv_heads=c.n_kv_heads or heads, head_dim=c.d_model // heads,
            intermediate_size=c.mlp_hidden_size or c.mlp_ratio * c.d_model,
            rope_theta=float(c.rope_theta), eps=float(c.rms_norm_eps), qkv_bias=False, qk_norm=False,
            tie_embeddings=bool(c.weight_tying), norm_weight_in_float32=False, rope_in_float32=True)
    if not isinstance(c, (DreamConfig, SDARConfig)):
        raise TypeError(f"no native architecture for {type(c).__name__}")
    _refuse(c, "hidden_act", c.hidden_act, allowed="silu")
    _refuse(c, "use_sliding_window", bool(c.use_sliding_window), allowed=False)
    _rope_scaling_none(c)
    sdar = isinstance(c, SDARConfig)
    if sdar:
        _refuse(c, "attention_bias", c.attention_bias, allowed=False)
    heads = c.num_attention_heads
    return Architecture(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_heads=heads,
        num_kv_heads=c.num_key_value_heads or heads,
        head_dim=c.head_dim if sdar else c.hidden_size // heads, intermediate_size=c.intermediate_size,
        rope_theta=float(c.rope_theta), eps=float(c.rms_norm_eps), qkv_bias=not sdar, qk_norm=sdar,
        tie_embeddings=bool(c.tie_word_embeddings), norm_weight_in_float32=sdar, rope_in_float32=False)


# ------------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square in float32 (every family's); `weight_in_float32`:
    the weight multiplies before the cast back (`Architecture.norm_weight_in_float32`)."""

    def __init__(self, width: int, eps: float, weight_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps, self.weight_in_float32 = eps, weight_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm is the families' h * rsqrt(mean(h²) + eps) in one kernel where torch has one (CUDA)
        h = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        if self.weight_in_float32:
            return (h * self.weight.float()).to(x.dtype)
        return self.weight * h.to(x.dtype)


def _rotate(q: torch.Tensor, k: torch.Tensor, rope: RopeTables, in_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) of the queries (B, H, T, Dh)
    and the keys (B, Hkv, T, Dh), back in their dtype; computed in float32 or in their dtype
    (`Architecture.rope_in_float32`). The tables (B, 1, T, Dh), float32: sin with its first half
    negated (`_NativeLM.forward`), so that the rotated halves need no negation of their own:
    (-x2)·s and x2·(-s) are the same number. Queries and keys go through one pass (seven kernels
    for both, not six each): the same numbers, each element's arithmetic its own. The explicit
    cast keeps the backward's too: the two paths' gradients are summed in float32 and rounded once."""
    H, dtype = q.size(1), q.dtype
    qk = torch.cat((q, k), dim=1)  # (B, H + Hkv, T, Dh)
    h = qk.float() if in_float32 else qk
    cos, sin = rope.cast(h.dtype)
    x1, x2 = h.chunk(2, dim=-1)
    out = (h * cos + torch.cat((x2, x1), dim=-1) * sin).to(dtype)
    return out[:, :H], out[:, H:]


class _Attention(nn.Module):
    """The projections under Qwen's names (LLaDA's block renames them, below)."""

    def __init__(self, a: Architecture) -> None:
        super().__init__()
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.eps, a.norm_weight_in_float32)
            self.k_norm = RMSNorm(a.head_dim, a.eps, a.norm_weight_in_float32)


def _attend(a: Architecture, h: torch.Tensor, proj: nn.Module, rope: RopeTables, mask: torch.Tensor | None,
            past: tuple[torch.Tensor, torch.Tensor] | None, write_at: slice | None = None,
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Normalised input h (B, T, D) -> attention output (B, T, H * Dh) before the output
    projection, and this call's keys and values with the cached ones before them (`write_at`:
    written into them there, `KVCache.write_at`). `proj` holds q_proj, k_proj, v_proj (and
    q_norm, k_norm where the family has them)."""
    B, T, _ = h.shape
    q = proj.q_proj(h).view(B, T, a.num_heads, a.head_dim)  # (B, T, H, Dh)
    k = proj.k_proj(h).view(B, T, a.num_kv_heads, a.head_dim)  # (B, T, Hkv, Dh)
    v = proj.v_proj(h).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
    if a.qk_norm:
        q, k = proj.q_norm(q), proj.k_norm(k)
    q, k = _rotate(q.transpose(1, 2), k.transpose(1, 2), rope, a.rope_in_float32)  # (B, H|Hkv, T, Dh)
    k, v = join_cached(past, k, v, write_at)  # (B, Hkv, Tc+T or Tc, Dh)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.num_kv_heads != a.num_heads)
    return y.transpose(1, 2).reshape(B, T, -1), (k, v)  # (B, T, H * Dh)


class _QwenLayer(nn.Module):
    """Qwen2 / Qwen3's decoder layer names: input_layernorm, self_attn, post_attention_layernorm, mlp."""

    def __init__(self, a: Architecture) -> None:
        super().__init__()
        self.arch = a
        self.input_layernorm = RMSNorm(a.hidden_size, a.eps, a.norm_weight_in_float32)
        self.self_attn = _Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.eps, a.norm_weight_in_float32)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x, rope, mask, past=None, write_at=None, keep=False):  # (B, T, D) -> (B, T, D), (k, v) | None
        y, kv = _attend(self.arch, self.input_layernorm(x), self.self_attn, rope, mask, past, write_at)
        x = x + self.self_attn.o_proj(y)
        h, mlp = self.post_attention_layernorm(x), self.mlp
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)), kv if keep else None


class DreamDecoderLayer(_QwenLayer):
    """Dream's layer (its published class name: FSDP wraps it)."""


class SDARDecoderLayer(_QwenLayer):
    """SDAR's and TraDo's layer (its published class name: FSDP wraps it)."""


class LLaDALlamaBlock(nn.Module):
    """LLaDA's llama block under its published names; ff_proj is the SwiGLU gate."""

    def __init__(self, a: Architecture) -> None:
        super().__init__()
        self.arch = a
        d, inner = a.hidden_size, a.num_heads * a.head_dim
        self.attn_norm = RMSNorm(d, a.eps)
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(d, a.num_kv_heads * a.head_dim, bias=False)
        self.attn_out = nn.Linear(inner, d, bias=False)
        self.ff_norm = RMSNorm(d, a.eps)
        self.ff_proj = nn.Linear(d, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, a.intermediate_size, bias=False)
        self.ff_out = nn.Linear(a.intermediate_size, d, bias=False)

    def forward(self, x, rope, mask, past=None, write_at=None, keep=False):  # (B, T, D) -> (B, T, D), (k, v) | None
        y, kv = _attend(self.arch, self.attn_norm(x), self, rope, mask, past, write_at)
        x = x + self.attn_out(y)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)), kv if keep else None


# ------------------------------------------------------------------------------ models
class _NativeLM(PreTrainedModel):
    """The forward every family shares; a subclass builds its modules under its published
    names and says where they are (`_parts`)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    block_attention = False
    """True: the model is read block by block and needs an explicit boolean mask (SDAR)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.arch = architecture(config)
        self.gradient_checkpointing = False  # True: recompute each layer in the backward, in eval mode too

    def _parts(self) -> tuple[nn.Embedding, nn.ModuleList, nn.Module, nn.Linear | None]:
        """The embedding, the layers, the final norm and the output head (None: tied)."""
        raise NotImplementedError

    def get_input_embeddings(self) -> nn.Embedding:
        return self._parts()[0]

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        raise NotImplementedError("stabledrl's native models keep their published embedding")

    def get_output_embeddings(self) -> nn.Linear | None:
        return self._parts()[3]

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to tie: a tied model has no output head of its own (`_parts`)."""

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", None) or getattr(self.config, "init_std", None) or 0.02
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        extend_cache: bool = False,
        logits_columns: slice | None = None,
        **unused: Any,
    ) -> MaskedLMOutput:
        """`attention_mask`: (B, Tc + T) key padding (1: a real token), or a boolean (B, T, Tc + T)
        or (B, 1, T, Tc + T) mask, True where query i may attend to key j, the Tc cached keys
        first; None: every token attends to every token (not for a block model).
        `position_ids` (B, T): with a 2-D mask they default to counts over the real tokens (left
        padding shifts nothing); required with a boolean mask or a cache.
        `past_key_values`: a `KVCache` the new tokens also attend to; `extend_cache` appends
        their keys and values to it (a cache with `write_at` takes them in place there instead,
        the mask over its Tc keys alone). The logits are the model's own (Dream's shifted by one);
        `logits_columns`: only those columns' (the final norm and the head run on them alone)."""
        B, T = input_ids.shape
        cache = past_key_values
        cached = cache is not None and len(cache) > 0
        if extend_cache and cache is None:
            raise ValueError("extend_cache needs a KVCache in past_key_values")
        write_at = check_write_at(cache, T, extend_cache)
        mask, position_ids = self._mask(input_ids, attention_mask, position_ids, len(cache) if cached else 0, write_at)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        # theta^(-2i/Dh), as every family's file writes it (there, a buffer)
        inv_freq = rope_frequencies(self.arch.rope_theta, self.arch.head_dim, input_ids.device)  # (Dh/2,)
        freqs = position_ids[:, None, :, None].float() * inv_freq  # (B, 1, T, Dh/2)
        c, s = freqs.cos(), freqs.sin()
        rope = RopeTables(torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1))  # (B, 1, T, Dh); sin signed for `_rotate`
        embed, layers, norm, head = self._parts()
        x = embed(input_ids)  # (B, T, D)
        new = []
        for i, layer in enumerate(layers):
            past = cache.layers[i] if cached else None
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # Keep the layer's input only; its activations are recomputed in the backward.
                x, kv = checkpoint(layer, x, rope, mask, past, write_at, extend_cache, use_reentrant=False)
            else:
                x, kv = layer(x, rope, mask, past, write_at, extend_cache)
            if extend_cache:  # a first call's keys are a view of the rotated queries' tensor: kept alone
                new.append((kv[0].clone(), kv[1]) if past is None else kv)
            del kv
        if extend_cache:
            cache.layers = new
        h = norm(x if logits_columns is None else x[:, logits_columns])
        logits = head(h) if head is not None else F.linear(h, embed.weight)  # (B, T, V)
        return MaskedLMOutput(logits=logits)

    def _mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              Tc: int, write_at: slice | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SDPA's boolean mask (B, 1, T, Tc + T) or, with `write_at`, (B, 1, T, Tc) (None: attend
        to all) and the position ids."""
        if attention_mask is None or attention_mask.dim() == 2:
            if self.block_attention:
                raise ValueError(f"{type(self).__name__} is a block-diffusion model: give it a boolean (B, T, T) "
                                 "mask (stabledrl.models.attention builds them)")
        elif position_ids is None:
            raise ValueError("position_ids are required with a boolean (B, T, Tc + T) attention mask")
        if Tc and (position_ids is None or attention_mask is None):
            raise ValueError("a KV cache needs position_ids and an attention mask over the cached keys and the new")
        mask, position_ids = sdpa_mask(input_ids, attention_mask, position_ids, Tc, write_at)  # the tiny model's
        if attention_mask is not None and attention_mask.dim() == 2 and _no_padding(attention_mask):
            return None, position_ids  # no padding: SDPA's unmasked path
        return mask, position_ids


_PADDING: WeakIdKeyDictionary = WeakIdKeyDictionary()  # key-padding mask -> (its version, whether all are kept)


def _no_padding(mask: torch.Tensor) -> bool:
    """Whether a (B, K) key-padding mask keeps every key: read off the device once a mask (and
    again after an in-place change), not in every call that passes it, as the sampler's later
    calls of a block do. A call replayed from a CUDA graph (`sampling.cuda_graphs`) may not read
    the device at all. An inference-mode tensor keeps no version to see a change by: read each time."""
    if mask.is_inference():
        return bool(mask.bool().all())
    seen = _PADDING.get(mask)
    if seen is None or seen[0] != mask._version:
        seen = _PADDING[mask] = (mask._version, bool(mask.bool().all()))
    return seen[1]


class LLaDAModelLM(_NativeLM):
    """LLaDA 8B Base / Instruct and LLaDA 1.5: ``model.transformer.{wte, blocks, ln_f, ff_out}``."""

    config_class = LLaDAConfig
    _no_split_modules = ["LLaDALlamaBlock"]

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__(config)
        a = self.arch
        self.model = nn.Module()
        self.model.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(a.vocab_size, a.hidden_size),
            blocks=nn.ModuleList(LLaDALlamaBlock(a) for _ in range(a.num_layers)),
            ln_f=RMSNorm(a.hidden_size, a.eps)))
        if not a.tie_embeddings:
            self.model.transformer.ff_out = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.post_init()

    def _parts(self):
        t = self.model.transformer
        return t.wte, t.blocks, t.ln_f, getattr(t, "ff_out", None)


class _QwenLM(_NativeLM):
    _layer: Callable[[Architecture], nn.Module]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        a = self.arch
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.model.layers = nn.ModuleList(type(self)._layer(a) for _ in range(a.num_layers))
        self.model.norm = RMSNorm(a.hidden_size, a.eps, a.norm_weight_in_float32)
        if not a.tie_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.post_init()

    def _parts(self):
        m = self.model
        return m.embed_tokens, m.layers, m.norm, getattr(self, "lm_head", None)


class DreamModel(_QwenLM):
    """Dream v0 7B Base / Instruct: Qwen2's layout; logits shifted by one."""

    config_class = DreamConfig
    _no_split_modules = ["DreamDecoderLayer"]
    _layer = DreamDecoderLayer


class SDARForCausalLM(_QwenLM):
    """SDAR 1.7B / 4B / 8B Chat and TraDo: Qwen3's layout, read as a block-diffusion model."""

    config_class = SDARConfig
    _no_split_modules = ["SDARDecoderLayer"]
    _layer = SDARDecoderLayer
    block_attention = True


NATIVE_MODELS: dict[str, type[_NativeLM]] = {"llada": LLaDAModelLM, "dream": DreamModel, "sdar": SDARForCausalLM}
"""Adapter name -> the native class that loads that family's checkpoints."""
