"""A tiny masked-diffusion transformer: the embedded default model and the test model.

Transformer with token embedding, RoPE, RMSNorm, SwiGLU MLP and
`F.scaled_dot_product_attention`. A `transformers.PreTrainedModel`, so `save_pretrained` /
`from_pretrained`, peft and accelerate work unchanged.

Two attention kinds, set in the config:
- ``full``: bidirectional (masked diffusion: LLaDA, MDLM). A 2-D key-padding mask is enough.
- ``block``: block diffusion (BD3-LM, SDAR). The weights are the same; what makes it a
  block model is the mask, and the model cannot guess where the prompt ends, so it
  requires an explicit boolean mask (`stabledrl.models.attention`: block-causal for
  [q ; y], staircase for [q ; y ; ỹ]) and refuses a 2-D one rather than attend to
  future blocks.

`KVCache` holds the rotated keys and values of tokens already processed (the prompt and
finished blocks) so that the block sampler feeds only the current block; `KVCache.select`
keeps some of its rows and positions (the full-attention sampler's approximate caches).

Shapes: B batch, T new tokens, Tc cached tokens, D model width, H heads, Dh = D / H,
V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

__all__ = ["TinyDiffusionConfig", "TinyDiffusionLM", "KVCache", "join_cached", "check_write_at", "rope_frequencies",
           "RopeTables", "sdpa_mask"]


# The fields of `TinyDiffusionConfig` and their defaults; `intermediate_size=None` means 4 * hidden_size.
_CONFIG_DEFAULTS: dict[str, object] = {
    "vocab_size": 32,
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "intermediate_size": None,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_kind": "full",  # "full" or "block"
    "block_size": None,
    "mask_token_id": None,
}


class TinyDiffusionConfig(PretrainedConfig):
    """Configuration of `TinyDiffusionLM`: keyword arguments named in `_CONFIG_DEFAULTS`
    (the rest, e.g. ``pad_token_id``, go to `PretrainedConfig`).

    `mask_token_id` is required: the diffusion process needs to know which token is M.
    """

    model_type = "stabledrl-tiny-diffusion"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    initializer_range: float
    attention_kind: Literal["full", "block"]
    block_size: int | None
    mask_token_id: int | None

    def __init__(self, **kwargs) -> None:
        # Keyword arguments only, filled from a table: `from_dict` calls cls(**config_dict).
        fields = {name: kwargs.pop(name, default) for name, default in _CONFIG_DEFAULTS.items()}
        hidden_size, num_attention_heads = fields["hidden_size"], fields["num_attention_heads"]
        attention_kind, block_size = fields["attention_kind"], fields["block_size"]
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads})"
            )
        if (hidden_size // num_attention_heads) % 2:
            raise ValueError("the head width hidden_size / num_attention_heads must be even for RoPE")
        if attention_kind not in ("full", "block"):
            raise ValueError(f"attention_kind must be 'full' or 'block', got {attention_kind!r}")
        if attention_kind == "block" and not (block_size and block_size > 0):
            raise ValueError("attention_kind='block' needs a positive block_size")
        fields["intermediate_size"] = fields["intermediate_size"] or 4 * hidden_size
        for name, value in fields.items():
            setattr(self, name, value)
        # The output head is its own matrix. transformers 4.x ties it to the embedding unless told
        # not to (5.x ties only declared pairs): a checkpoint would then load one into the other.
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


@functools.lru_cache(maxsize=None)
def rope_frequencies(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    """(dim/2,) RoPE's frequencies theta^(-2i/dim) in float32, computed on the CPU (the same values on
    every device) and kept per device. Not a buffer: transformers 5 leaves a non-persistent buffer
    unset (zeros) where it loads a model for FSDP's RAM-efficient start, and accelerate keeps it so."""
    return (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(device)


class RopeTables:
    """A forward's RoPE tables, float32 (`cos`, `sin`), as its layers receive them. A plain object,
    not tensors, on purpose: FSDP's mixed precision casts the floating-point tensors a wrapped
    layer is called with to its compute dtype (`MixedPrecisionPolicy.cast_forward_inputs`, on by
    default and under accelerate's bf16), and would round the tables to bfloat16 where the model
    rotates in float32 (LLaDA's published block makes its tables inside itself, out of FSDP's
    reach; docs/scale-out.md, "Precision"). `cast(dtype)`: the tables in `dtype`, made once
    a forward however many layers ask."""

    __slots__ = ("cos", "sin", "_cast")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {cos.dtype: (cos, sin)}

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]


def sdpa_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              Tc: int = 0, write_at: slice | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """SDPA's boolean mask (B, 1, T, K) (None: attend to everything) and the position ids,
    counted over the real tokens when a (B, K) key-padding mask is given without them. The
    keys are the Tc cached ones and then the T new ones (K = Tc + T), or, with `write_at` (a
    cache written in place, `KVCache.write_at`), the Tc cached ones alone (K = Tc), the new
    tokens' own among them at write_at. The mask is (B, K) key padding, or a boolean (B, T, K) /
    (B, 1, T, K) mask, True where query i may attend to key j. Every query keeps its own key."""
    B, T = input_ids.shape
    K, own = (Tc + T, Tc) if write_at is None else (Tc, write_at.start)
    if attention_mask is None:
        if Tc:
            raise ValueError("an attention_mask is required with a KV cache")
        return None, position_ids
    if attention_mask.dim() == 2:
        keep = attention_mask.bool()  # (B, K)
        if keep.size(1) != K:
            raise ValueError(f"a 2-D attention_mask needs {'Tc+T' if write_at is None else 'Tc'} = {K} columns, "
                             f"got {keep.size(1)}")
        mask = keep[:, None, :].expand(B, T, K)  # (B, T, K)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        mask = attention_mask.bool().reshape(B, T, K)
    # A query with no key to attend to (a padding row) would make SDPA return NaN; letting every
    # token see itself keeps padding rows finite and unused.
    keys = torch.arange(K, device=input_ids.device)
    mask = mask | (keys[None, :] == own + torch.arange(T, device=input_ids.device)[:, None])
    return mask[:, None], position_ids  # (B, 1, T, K)


def _rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    # x: (B, H, T, Dh); cos/sin: (B, 1, T, Dh/2), float32. Rotate pairs (first half, second half).
    cos, sin = rope.cos, rope.sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class KVCache:
    """Per-layer keys and values (B, H, Tc, Dh) of the tokens processed so far.

    `write_at`: None (the usual cache), a forward's new tokens attend to the cached keys and
    to their own after them, and `extend_cache` appends theirs. A slice of the cached positions
    (T long): the new tokens are those positions fed again; their keys and values overwrite
    the cached ones there, in place, and they attend to all Tc positions, under a mask over
    those Tc alone. Fast-dLLM's caches keep a whole sequence's keys so, feeding a run of its
    columns each call: no copy of the cache per call (`stabledrl.sampling._ApproxCache`)."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.write_at: slice | None = None

    def __len__(self) -> int:
        """Tc, the number of cached positions."""
        return self.layers[0][0].size(2) if self.layers else 0

    def select(self, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> "KVCache":
        """A new cache of the batch rows `rows` and cached positions `cols` (index tensors;
        None: all), in that order. The order of the cached positions does not matter to the
        model (their positions are in the rotated keys); a query's mask must follow it. The
        new cache is written in place where this one is (`write_at`), which needs `cols` None."""
        if cols is not None and self.write_at is not None:
            raise ValueError("select(cols=...) would move the positions write_at names")
        out = KVCache()
        out.write_at = self.write_at
        for k, v in self.layers:  # (B, H, Tc, Dh) each
            if rows is not None:
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            if cols is not None:
                k, v = k.index_select(2, cols), v.index_select(2, cols)
            out.layers.append((k, v))
        return out

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps the batch rows `rows` (an index tensor) alone, in that order, layer by layer:
        beside the cache, one layer's copy at a time, not a second cache."""
        for i, (k, v) in enumerate(self.layers):
            self.layers[i] = (k.index_select(0, rows), v.index_select(0, rows))


def join_cached(past: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor,
                write_at: slice | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values to attend to: this call's (B, H, T, Dh) alone (no cache),
    after the cached ones (B, H, Tc + T, Dh), or written into them at `write_at` (the cache's
    own tensors, (B, H, Tc, Dh): `KVCache.write_at`)."""
    if past is None:
        return k, v
    if write_at is None:
        return torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    past[0][:, :, write_at] = k
    past[1][:, :, write_at] = v
    return past


def check_write_at(cache: KVCache | None, T: int, extend_cache: bool) -> slice | None:
    """The cache's `write_at` where it has one (else None), checked against T new tokens."""
    at = cache.write_at if cache is not None and len(cache) > 0 else None
    if at is None:
        return None
    if extend_cache:
        raise ValueError("a cache written in place (write_at) is not extended")
    start, stop, step = at.indices(len(cache))
    if step != 1 or stop - start != T:
        raise ValueError(f"write_at {at} must name a run of the cache's {len(cache)} positions, one per new token: "
                         f"{T} tokens were fed")
    return slice(start, stop)


class _Block(nn.Module):
    def __init__(self, cfg: TinyDiffusionConfig) -> None:
        super().__init__()
        d, self.n_head = cfg.hidden_size, cfg.num_attention_heads
        self.attn_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(
        self, x: torch.Tensor, rope: RopeTables, attn_mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None, write_at: slice | None = None, keep: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(D, dim=-1)  # 3 x (B, T, D)
        q, k, v = (z.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, Dh)
        # RoPE in float32 (the tables'), then back to v's dtype: SDPA needs one dtype, which a
        # bfloat16 model without autocast would otherwise break (autocast casts q and k so anyway).
        q, k = _rope(q, rope).to(v.dtype), _rope(k, rope).to(v.dtype)
        k, v = join_cached(past, k, v, write_at)  # (B, H, Tc+T or Tc, Dh)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, Dh)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # 2 x (B, T, I)
        return x + self.down(F.silu(gate) * up), (k, v) if keep else None  # `keep`: for a cache


class TinyDiffusionLM(PreTrainedModel):
    """Masked-diffusion LM: logits[:, i] predict token i (no shift)."""

    config_class = TinyDiffusionConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    supports_gradient_checkpointing = True
    _no_split_modules = ["_Block"]  # FSDP's transformer-layer wrap shards each block on its own

    def __init__(self, config: TinyDiffusionConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False  # True: recompute each block in the backward (ModelConfig)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        extend_cache: bool = False,
        logits_columns: slice | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """`attention_mask`: (B, T) with 1 for real tokens (key padding; full attention
        only), or a boolean (B, T, Tc+T) / (B, 1, T, Tc+T) mask, True where query i may
        attend to key j (the Tc cached keys first).
        `position_ids`: (B, T); with a (B, T) mask they default to counts over the real
        tokens, so left padding does not shift positions; required with a boolean mask
        (whose layout, e.g. the staircase copy ỹ, the model cannot infer) and with a cache.
        `past_key_values`: a `KVCache` whose keys the new tokens may attend to; with
        `extend_cache` the new tokens' keys and values are appended to it (or, where the
        cache has `write_at`, written into it there, the mask then over its Tc keys alone).
        `logits_columns`: the logits of those columns only (the final norm and head run on them alone).
        `labels` (B, T) with -100 for ignored positions gives the mean cross-entropy as
        `loss` (no diffusion weighting: see `stabledrl.sft`)."""
        B, T = input_ids.shape
        cached = past_key_values is not None and len(past_key_values) > 0
        self._check_inputs(attention_mask, position_ids, cached)
        past = past_key_values if cached else None
        write_at = check_write_at(past_key_values, T, extend_cache)
        mask, position_ids = sdpa_mask(input_ids, attention_mask, position_ids, len(past) if past is not None else 0,
                                       write_at)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        inv_freq = rope_frequencies(float(self.config.rope_theta), self.config.hidden_size // self.config.num_attention_heads,
                                    input_ids.device)  # (Dh/2,)
        angles = position_ids[:, None, :, None].float() * inv_freq  # (B, 1, T, Dh/2)
        rope = RopeTables(angles.cos(), angles.sin())
        if extend_cache and past_key_values is None:
            raise ValueError("extend_cache needs a KVCache in past_key_values")
        x = self._run_blocks(self.embed(input_ids), rope, mask, past, past_key_values if extend_cache else None,
                             write_at)
        logits = self.lm_head(self.norm(x if logits_columns is None else x[:, logits_columns]))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits)

    def _check_inputs(
        self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, cached: bool
    ) -> None:
        """Refuse the inputs whose layout the model would otherwise have to guess."""
        if self.config.attention_kind == "block" and (attention_mask is None or attention_mask.dim() == 2):
            raise ValueError(
                "a block-attention model needs an explicit boolean (B, T, T) attention mask: build it with "
                "stabledrl.models.attention.block_causal_attention_mask (for [q ; y]) or "
                "staircase_attention_mask (for [q ; y ; ỹ])"
            )
        if cached and position_ids is None:
            raise ValueError("position_ids are required with a KV cache")
        if attention_mask is not None and attention_mask.dim() > 2 and position_ids is None:
            raise ValueError(
                "position_ids are required with a boolean attention mask: use "
                "stabledrl.models.attention.staircase_position_ids (for [q ; y ; ỹ]) or "
                "stabledrl.data.position_ids (for [q ; y])"
            )

    def _run_blocks(
        self, x: torch.Tensor, rope: RopeTables, mask: torch.Tensor | None,
        past: KVCache | None, extend: KVCache | None, write_at: slice | None = None,
    ) -> torch.Tensor:
        """The blocks over embeddings `x` (B, T, D), attending to the cached keys of `past`
        (non-empty, or None; `write_at`: its positions the new tokens overwrite); the new keys
        and values replace `extend`'s layers (None: kept nowhere)."""
        new_layers = []
        for i, block in enumerate(self.blocks):
            layer_past = past.layers[i] if past is not None else None
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # Keep only the block's input; its activations are recomputed in the backward.
                # Unlike transformers' layers, also in eval mode: the RL update runs in eval mode.
                x, kv = checkpoint(block, x, rope, mask, layer_past, write_at, extend is not None, use_reentrant=False)
            else:
                x, kv = block(x, rope, mask, layer_past, write_at, extend is not None)
            # A block returns its keys and values only for the cache (`keep`): v is a view of the whole
            # qkv output, so holding them would keep 3D + D values per token and layer to the end (and
            # FSDP2 warns of a layer that returns a view, which an in-place change would cut from the backward).
            if extend is not None:
                new_layers.append(kv)
            del kv
        if extend is not None:
            extend.layers = new_layers
        return x
