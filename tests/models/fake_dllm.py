"""Stand-ins for the published modelling code of LLaDA, Dream and SDAR, loaded as remote code.

The real checkpoints ship their modelling files beside the weights and are loaded with
``trust_remote_code``; the tests save these tiny classes the same way (config.json's
``auto_map`` names this file, copied into the directory), so the adapters' real loading path
runs without the Hub. Each class reproduces the interface and the quirks of the file it
stands for, read from the published code (GSAI-ML/LLaDA-8B-Instruct ``modeling_llada.py``,
Dream-org/Dream-v0-Instruct-7B ``modeling_dream.py`` and ``generation_utils.py``, JetLM
SDAR-*-Chat / TraDo ``modeling_sdar.py`` and SDAR's ``generate.py``); the arithmetic is
written here, small, under the published module and parameter names and config fields
(stabledrl's native models load these checkpoints as they load the published ones):
LLaDA's ``model.transformer.{wte, blocks.i.{attn_norm, q_proj, k_proj, v_proj, attn_out,
ff_norm, ff_proj, up_proj, ff_out}, ln_f, ff_out}``, Dream's and SDAR's Qwen names
(``model.layers.i.self_attn.q_proj`` ..., Dream's q/k/v biases, SDAR's ``q_norm``/``k_norm``),
grouped key/value heads.

Copies in circulation differ in their attention while sharing class names and config; the
module constants ``LLADA_COPY`` and ``DREAM_COPY`` say which copy this file stands for (a test
saves a copy of the file with the line rewritten, as a checkpoint carries its own file).

LLaDA (``LLaDAModelLM``, model_type ``llada``)
  - ``forward(input_ids, inputs_embeds, attention_mask, attention_bias, past_key_values, labels,
    use_cache, ...)``: a (B, T) key-padding mask, applied only when it holds a 0; a bool
    ``attention_bias`` (True: may attend). No position ids: RoPE over columns 0..T-1.
  - ``LLADA_COPY``: "authors" (dLLM-RL, StableDRL: a mask with a 0 and no bias -> the causal
    bias), "hub" (the attention call drops every mask and bias), "key_padding"
    (bidirectional, padding masked: attributed to ML-GSAI's copy, whose repository ships none);
    "causal" is no published copy: a causal model under LLaDA's names, which must be refused.
  - ``_no_split_modules`` names three block classes; a llama-type model holds only
    ``LLaDALlamaBlock``. Built with ``init_params=False``; ``reset_parameters()`` initialises.
  - No KV cache: the inner model asserts ``not use_cache``, and ``use_cache`` defaults to the
    config's. Logits unshifted. The mask id lives in the config, not in the tokenizer.
  - Never calls ``post_init`` (the cause of its failure under transformers 5.x) and overrides
    ``tie_weights(self)`` with no arguments; ``can_generate`` is an instance method.
  - Activation checkpointing through its own ``model.set_activation_checkpointing(strategy)``;
    the class does not declare ``supports_gradient_checkpointing``, so transformers'
    ``gradient_checkpointing_enable()`` refuses it.
Dream (``DreamModel``, model_type ``Dream``)
  - ``forward(input_ids, attention_mask, position_ids, ...)``: the mask goes to SDPA as is
    (a 4-D boolean mask, True: may attend; anything else that is not a tensor means none);
    ``DREAM_COPY = "dllm_rl"``: cast to the query dtype first, so a boolean mask becomes an
    additive 0/1 and masks nothing. Layers ``DreamDecoderLayer``, listed in ``_no_split_modules``.
  - Initialised from an AR model: logits[:, i] are read as predicting token i + 1.
  - RoPE from ``ROPE_INIT_FUNCTIONS[rope_type]``, rope_type "default" when ``rope_scaling`` is
    null (the key transformers 5.x removed).
  - ``from_pretrained`` replaces the generation config by ``DreamGenerationConfig``, whose
    ``validate(self, is_init=False)`` predates ``strict``: ``save_pretrained`` fails on it.
  - ``supports_gradient_checkpointing``; the base model's loop checkpoints a layer
    (``self._gradient_checkpointing_func(layer.__call__, ...)``) only when
    ``self.gradient_checkpointing and self.training``.
SDAR / TraDo (``SDARForCausalLM``, model_type ``sdar``)
  - Its module imports ``LossKwargs`` from ``transformers.utils`` (gone since 4.56) and, at
    module level, flash-attn's Triton ``rms_norm_fn`` (its RMSNorm) and ``flash_attn_func``
    (its all-True-mask attention): without flash-attn (or stabledrl's shim) it does not import.
  - Layers ``SDARDecoderLayer``, listed in ``_no_split_modules``.
  - Decoder layers are transformers' ``GradientCheckpointingLayer`` (checkpointed only when
    the layer itself is training); the attention inside refuses train mode (its flex path).
  - In eval mode the attention calls ``attention_mask.bool()`` and hands it to SDPA (an
    all-True mask takes a no-mask path): an additive 0/-inf mask would be inverted.
  - In train mode ``forward`` is its own block-diffusion SFT loss: it noises the input itself,
    needs ``labels`` and returns no logits.
  - Logits unshifted (its sampler reads position i for token i); ``position_ids`` default to
    the positions after the cached tokens.
  - A transformers ``DynamicCache`` in ``past_key_values`` (one is made when ``use_cache`` and
    none is given) and its own ``store_kv`` flag: with it a layer appends its keys and values
    to the cache and attends to all of them; without it the new tokens attend to the cached
    keys and their own, and nothing is stored. The mask covers the cached keys, then the new
    (SDAR's ``generate.py`` decodes a block with ``store_kv=False``, then stores it).
  - Its blocks: S = ``config.block_size`` tokens counted from each sequence's first token,
    prompt and answer alike, so the prompt's tail and the first answer tokens share a block.
    ``block_diff_mask`` / ``block_attn_mask`` (module functions, as in SDAR's file) build its
    SFT mask over [x_t ; x_0] that way; SDAR's ``generate.py`` builds its sampling mask the
    same way (``tests/test_prompt_attention.py`` writes that one out).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput
from transformers.utils import LossKwargs  # as SDAR's file does: missing from transformers >= 4.56

# JetAstra/SDAR training/model/SDAR-8B-Chat/modeling_sdar.py:51: outside any try, so the file
# needs flash-attn to import; :54-58 the attention functions, inside a bare try/except.
from flash_attn.ops.triton.layer_norm import rms_norm_fn as flash_rms_norm

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
except:  # noqa: E722 (SDAR's own)
    pass

LLADA_COPY = "authors"  # which modeling_llada.py this file stands for (module docstring)
DREAM_COPY = "hub"  # which modeling_dream.py


def _rotate(x, cos, sin):  # x: (B, H, T, Dh); cos/sin: (B, 1, T, Dh). Every family's rotate_half.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _cos_sin(inv_freq, positions):  # (Dh/2,), (B, T) -> two (B, 1, T, Dh)
    freqs = positions[:, :, None].float() * inv_freq[None, None, :]  # (B, T, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _inv_freq(theta, dim):  # every family's: theta ** -(arange(0, dim, 2) / dim)
    return 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)


class _RMSNorm(nn.Module):
    """LLaDA's RMSLayerNorm (modeling_llada.py:315-327) and Qwen2's: normalise in float32, cast
    back, then the weight."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Layer(nn.Module):
    """Pre-norm attention and SwiGLU MLP; `mask` is whatever the owning model hands to SDPA.
    A subclass names its modules as its family's file does (`_project`, `_out`, `_norm1`,
    `_norm2`, `_mlp`); grouped key/value heads are repeated (modeling_llada.py:644-651, Qwen2's repeat_kv)."""

    heads = kv_heads = head_dim = 0

    def attend(self, q, k, v, mask):  # (B, H, T, Dh), (B, Hkv, S, Dh) x 2 -> (B, H, T, Dh)
        if k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, x, cos, sin, mask, kv=None):  # kv: (k, v) -> the keys and values attended to (a cache)
        B, T, D = x.shape
        q, k, v = self._project(self._norm1(x))  # (B, T, H*Dh), (B, T, Hkv*Dh) x 2
        q = q.view(B, T, self.heads, self.head_dim)
        k = k.view(B, T, self.kv_heads, self.head_dim)
        q, k = self._qk_norm(q, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, Dh), (B, Hkv, T, Dh)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        k = _rotate(k, cos, sin)
        if kv is not None:
            k, v = kv(k, v)  # (B, Hkv, Tc + T, Dh) each
        a = self.attend(_rotate(q, cos, sin), k, v, mask)
        x = x + self._out(a.transpose(1, 2).reshape(B, T, -1))
        return x + self._mlp(self._norm2(x))

    def _qk_norm(self, q, k):
        return q, k


class _QwenLayer(_Layer):
    """Qwen2's layer names (Dream; SDAR adds q_norm, k_norm)."""

    def __init__(self, d, heads, kv_heads, head_dim, inter, eps, qkv_bias, norm=_RMSNorm, attention=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm, self.post_attention_layernorm = norm(d, eps), norm(d, eps)
        self.self_attn = attention if attention is not None else nn.Module()
        self.self_attn.q_proj = nn.Linear(d, heads * head_dim, bias=qkv_bias)
        self.self_attn.k_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.self_attn.v_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        self.mlp.up_proj = nn.Linear(d, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, d, bias=False)

    def _norm1(self, x):
        return self.input_layernorm(x)

    def _norm2(self, x):
        return self.post_attention_layernorm(x)

    def _project(self, h):
        a = self.self_attn
        return a.q_proj(h), a.k_proj(h), a.v_proj(h)

    def _out(self, y):
        return self.self_attn.o_proj(y)

    def _mlp(self, h):
        return self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


# ----------------------------------------------------------------------------------- LLaDA
class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    # The Hub config.json's fields (LLaDA-8B-Instruct), small; the arithmetic switches at their values.
    def __init__(self, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, mlp_hidden_size=48,
                 rope_theta=500000.0, rms_norm_eps=1e-5, max_sequence_length=128, mask_token_id=None, use_cache=False,
                 weight_tying=False, embedding_size=None, block_type="llama", activation_type="silu",
                 layer_norm_type="rms", rope=True, rope_full_precision=True, include_bias=False,
                 include_qkv_bias=False, alibi=False, attention_layer_norm=False, scale_logits=False,
                 input_emb_norm=False, block_group_size=1, **kwargs):
        self.vocab_size, self.d_model, self.n_heads, self.n_kv_heads = vocab_size, d_model, n_heads, n_kv_heads
        self.n_layers, self.mlp_hidden_size, self.rms_norm_eps = n_layers, mlp_hidden_size, rms_norm_eps
        self.rope_theta, self.max_sequence_length = rope_theta, max_sequence_length
        self.mask_token_id, self.weight_tying = mask_token_id, weight_tying
        self.embedding_size = embedding_size if embedding_size is not None else vocab_size
        self.block_type, self.activation_type, self.layer_norm_type = block_type, activation_type, layer_norm_type
        self.rope, self.rope_full_precision, self.include_bias = rope, rope_full_precision, include_bias
        self.include_qkv_bias, self.alibi, self.attention_layer_norm = include_qkv_bias, alibi, attention_layer_norm
        self.scale_logits, self.input_emb_norm, self.block_group_size = scale_logits, input_emb_norm, block_group_size
        super().__init__(use_cache=use_cache, **kwargs)
        self.use_cache = use_cache  # configuration_llada.py:441 passes it on; transformers 5's base drops it


class LLaDABlock(_Layer):
    """Gen-Verse/dLLM-RL models/llada/modeling_llada.py:521, the base of the two block types."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.d_model // c.n_heads
        d, inner = c.d_model, c.mlp_hidden_size  # :530 hidden_size; :854-873 the llama block's projections
        self.attn_norm, self.ff_norm = _RMSNorm(d, c.rms_norm_eps), _RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.ff_out = nn.Linear(inner, d, bias=False)

    def _norm1(self, x):
        return self.attn_norm(x)

    def _norm2(self, x):
        return self.ff_norm(x)

    def _project(self, h):
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def _out(self, y):
        return self.attn_out(y)

    def _mlp(self, h):  # :925-931: ff_proj is the gate, act(ff_proj(x)) * up_proj(x)
        return self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))

    def attend(self, q, k, v, mask):
        # "hub": the attention call passes attn_mask=None (the Hub copy's behaviour; the same line is in
        # dLLM-RL sample/llada/modeling_llada.py:767); the others pass the bias (models/llada/...:716).
        return super().attend(q, k, v, None if LLADA_COPY == "hub" else mask)


class LLaDASequentialBlock(LLaDABlock):
    """modeling_llada.py:747, block_type "sequential": never built for the llama-type checkpoints."""


class LLaDALlamaBlock(LLaDABlock):
    """modeling_llada.py:837, block_type "llama": the block of LLaDA-8B."""


def _causal_bias(T, device):  # modeling_llada.py:494 get_causal_attention_bias: (1, 1, T, T), min above the diagonal
    return torch.full((T, T), torch.finfo(torch.float32).min, device=device).triu(1)[None, None]


class LLaDAModel(nn.Module):
    """The inner model (not a PreTrainedModel), with LLaDA's checkpointing hook."""

    def __init__(self, config, init_params=True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.embedding_size, config.d_model),  # modeling_llada.py:1061-1064
            blocks=nn.ModuleList(LLaDALlamaBlock(config) for _ in range(config.n_layers)),
            ln_f=_RMSNorm(config.d_model, config.rms_norm_eps),
            ff_out=nn.Linear(config.d_model, config.embedding_size, bias=False)))  # :1083-1092 (weight_tying false)
        self.register_buffer("inv_freq", _inv_freq(config.rope_theta, config.d_model // config.n_heads),
                             persistent=False)  # :392-393
        self.activation_checkpointing_strategy = None
        self.checkpointed_calls = 0  # for the tests: blocks run through torch.utils.checkpoint
        if init_params:  # modeling_llada.py:1096; LLaDAModelLM passes init_params=False (:1393)
            self.reset_parameters()

    def reset_parameters(self):  # modeling_llada.py:1122 (its own normal init, small here)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def set_activation_checkpointing(self, strategy):
        if strategy not in (None, "whole_layer", "one_in_two", "one_in_three", "one_in_four", "fine_grained"):
            raise ValueError(f"unknown activation checkpointing strategy {strategy!r}")
        self.activation_checkpointing_strategy = strategy

    def forward(self, input_ids, input_embeddings=None, attention_mask=None, attention_bias=None,
                past_key_values=None, use_cache=False, output_hidden_states=None):
        assert past_key_values is None and not use_cache, "The kvcache is not suppotred for MDM."
        B, T = input_ids.shape
        x = self.transformer.wte(input_ids) if input_embeddings is None else input_embeddings  # (B, T, D)
        low = torch.finfo(torch.float32).min
        padding = None  # modeling_llada.py:1244: a (B, T) mask counts only when it holds a 0
        if attention_mask is not None and 0.0 in attention_mask:
            keys = attention_mask.float().view(B, -1)[:, None, None, :]  # (B, 1, 1, T)
            padding = (1.0 - keys) * low
        bias = None
        if attention_bias is not None or padding is not None:
            if attention_bias is None:  # :1263-1268: no bias given -> the causal one, in the authors' copies
                bias = _causal_bias(T, x.device) if LLADA_COPY == "authors" else torch.zeros(1, 1, T, T, device=x.device)
            elif attention_bias.dtype in (torch.int8, torch.bool):  # :1269: 0 -> min
                bias = attention_bias.float().masked_fill(attention_bias == 0, low)
            else:
                bias = attention_bias.float()
            bias = bias[:, :, :T, :T]
            if padding is not None:
                bias = (bias + padding).clamp(min=low)  # :1288 ensure_finite_
        if LLADA_COPY == "causal":  # not a published copy (module docstring): causal whatever is passed
            bias = _causal_bias(T, x.device) if bias is None else (bias + _causal_bias(T, x.device)).clamp(min=low)
        cos, sin = _cos_sin(self.inv_freq, torch.arange(T, device=x.device).expand(B, T))  # columns, not real positions
        for i, block in enumerate(self.transformer.blocks):
            s = self.activation_checkpointing_strategy
            if s == "whole_layer" or (s == "one_in_two" and i % 2 == 0):
                self.checkpointed_calls += 1
                x = checkpoint(block, x, cos, sin, bias, use_reentrant=False)
            else:
                x = block(x, cos, sin, bias)
        return self.transformer.ff_out(self.transformer.ln_f(x))  # (B, T, V), unshifted


class LLaDAModelLM(PreTrainedModel):
    """Barebones wrapper, as LLaDA's: no post_init, its own tie_weights and can_generate."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    # modeling_llada.py:1391 (dLLM-RL; StableDRL networks/modeling_llada.py:1399): three names, one present
    _no_split_modules = ["LLaDABlock", "LLaDASequentialBlock", "LLaDALlamaBlock"]

    def __init__(self, config, model=None, init_params=False):
        super().__init__(config)
        self.model = model or LLaDAModel(config, init_params=init_params)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, attention_bias=None,
                past_key_values=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None):
        if use_cache is None:
            use_cache = self.config.use_cache
        logits = self.model(input_ids, inputs_embeds, attention_mask, attention_bias, past_key_values, use_cache)
        return CausalLMOutputWithPast(logits=logits)

    def can_generate(self):
        return True

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def set_input_embeddings(self, value):
        self.model.transformer.wte = value

    def get_output_embeddings(self):
        return self.model.transformer.ff_out

    def tie_weights(self):
        if self.config.weight_tying:
            self.model.transformer.ff_out = self.model.transformer.wte


# ----------------------------------------------------------------------------------- Dream
class DreamConfig(PretrainedConfig):
    model_type = "Dream"

    # Dream-v0-Instruct-7B's config.json fields, small.
    def __init__(self, vocab_size=32, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                 num_hidden_layers=2, rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6, hidden_act="silu",
                 use_sliding_window=False, max_position_embeddings=128, mask_token_id=None, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.num_key_value_heads, self.rms_norm_eps, self.hidden_act = num_key_value_heads, rms_norm_eps, hidden_act
        self.rope_theta, self.rope_scaling, self.max_position_embeddings = rope_theta, rope_scaling, max_position_embeddings
        self.use_sliding_window, self.mask_token_id = use_sliding_window, mask_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class DreamGenerationConfig(GenerationConfig):
    def __init__(self, **kwargs):
        self.temperature = kwargs.pop("temperature", 0.0)
        self.steps = kwargs.pop("steps", 512)
        self.alg = kwargs.pop("alg", "origin")
        self.mask_token_id = kwargs.pop("mask_token_id", None)
        self.pad_token_id = kwargs.pop("pad_token_id", None)
        self.bos_token_id = kwargs.pop("bos_token_id", None)
        self.eos_token_id = kwargs.pop("eos_token_id", None)
        self._from_model_config = kwargs.pop("_from_model_config", False)
        self._commit_hash = kwargs.pop("_commit_hash", None)
        self.transformers_version = kwargs.pop("transformers_version", None)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.validate(is_init=True)

    def validate(self, is_init=False):  # Dream's signature: no `strict`
        pass


class DreamGenerationMixin:
    """Dream's sampler lives here; the adapters never call it."""


class DreamDecoderLayer(_QwenLayer):
    """Gen-Verse/dLLM-RL models/dream/modeling_dream.py:460 (its SDPA attention at :436-444); Qwen2's
    names, biases on q, k and v only."""

    def __init__(self, c):
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.hidden_size // c.num_attention_heads, c.intermediate_size, c.rms_norm_eps, qkv_bias=True)

    def attend(self, q, k, v, mask):
        if DREAM_COPY == "dllm_rl" and mask is not None:  # models/dream/modeling_dream.py:441: .to(q dtype)
            mask = mask.to(q.dtype)  # a boolean mask becomes 0/1 added to the scores: nothing masked
        return super().attend(q, k, v, mask)


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DreamDecoderLayer"]  # modeling_dream.py:551
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model.generation_config = DreamGenerationConfig.from_pretrained(pretrained_model_name_or_path)
        return model


class DreamBaseModel(DreamPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        # modeling_dream.py reads ROPE_INIT_FUNCTIONS[rope_type], rope_type "default" when rope_scaling is null:
        # transformers 5 removed that key, so the real file fails there (stabledrl refuses Dream's remote code
        # under 5.x first, _compat.check_remote_code_supported); the stand-in computes the default itself.
        rope_type = "default" if config.rope_scaling is None else config.rope_scaling.get("rope_type")
        assert rope_type == "default", "the stand-in computes the default RoPE only"
        self.register_buffer("inv_freq", _inv_freq(config.rope_theta, config.hidden_size // config.num_attention_heads),
                             persistent=False)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = _cos_sin(self.inv_freq, position_ids)
        x = self.embed_tokens(input_ids)
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None  # "full" -> none
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:  # Dream's gate: train mode only
                x = self._gradient_checkpointing_func(layer.__call__, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask)
        return self.norm(x)


class DreamModel(DreamGenerationMixin, DreamPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None, num_logits_to_keep=0):
        return MaskedLMOutput(logits=self.lm_head(self.model(input_ids, attention_mask, position_ids)))


# ----------------------------------------------------------------------------------- SDAR
class KwargsForCausalLM(FlashAttentionKwargs, LossKwargs):
    ...


class SDARConfig(PretrainedConfig):
    model_type = "sdar"

    # SDAR-8B-Chat's config.json fields, small (head_dim its own, not hidden / heads).
    def __init__(self, vocab_size=32, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=24, num_hidden_layers=2, rope_theta=1000000.0, rope_scaling=None,
                 rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, use_sliding_window=False,
                 max_position_embeddings=128, block_size=4, fuse_cross_entropy=False, use_cache=True,
                 **kwargs):  # configuration_sdar.py:165 use_cache
        self.vocab_size, self.hidden_size, self.use_cache = vocab_size, hidden_size, use_cache
        self.intermediate_size, self.num_key_value_heads, self.head_dim = intermediate_size, num_key_value_heads, head_dim
        self.rms_norm_eps, self.hidden_act, self.attention_bias = rms_norm_eps, hidden_act, attention_bias
        self.use_sliding_window = use_sliding_window
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.rope_theta, self.rope_scaling, self.max_position_embeddings = rope_theta, rope_scaling, max_position_embeddings
        self.block_size, self.fuse_cross_entropy = block_size, fuse_cross_entropy
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def block_diff_mask(b, h, q_idx, kv_idx, block_size=None, n=None):
    """SDAR's SFT mask over one sample's [x_t ; x_0] (n tokens each; True = may attend): a
    token's block is its index in its copy // block_size; x_t attends to its own block of
    x_t and to x_0's earlier blocks, x_0 to x_0's blocks up to its own."""
    noisy_q, noisy_kv = q_idx < n, kv_idx < n
    blk_q = torch.where(noisy_q, q_idx, q_idx - n) // block_size
    blk_kv = torch.where(noisy_kv, kv_idx, kv_idx - n) // block_size
    own_block = (blk_q == blk_kv) & (noisy_q == noisy_kv)
    earlier_clean = noisy_q & ~noisy_kv & (blk_kv < blk_q)
    clean_causal = ~noisy_q & ~noisy_kv & (blk_kv <= blk_q)
    return own_block | earlier_clean | clean_causal


def block_attn_mask(num_tokens, block_size, device):
    """(B, 2N, 2N) bool: for each row, one block_diff_mask per packed sample (its lengths
    `num_tokens[b]`), on the diagonal."""
    rows = []
    for counts in num_tokens:
        per_sample = [block_diff_mask(None, None, torch.arange(2 * n, device=device)[:, None],
                                      torch.arange(2 * n, device=device)[None, :], block_size, n)
                      for n in (int(c) for c in counts)]
        rows.append(torch.block_diag(*per_sample))
    return torch.stack(rows)


class SDARRMSNorm(nn.Module):
    """modeling_sdar.py:356: its forward is flash-attn's Triton rms_norm_fn (:366)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        return flash_rms_norm(x, weight=self.weight, bias=None, eps=self.variance_epsilon)


class SDARAttention(nn.Module):
    """modeling_sdar.py:214: q, k, v, o projections without biases; q_norm and k_norm, RMSNorms over
    each head (:227-229), applied to the projections before RoPE (:251-253)."""

    def __init__(self, c):
        super().__init__()
        self.q_norm = SDARRMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = SDARRMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def attend(self, q, k, v, mask):  # modeling_sdar.py:570-596, the eval path (the attention checks its own mode)
        if self.training:
            raise RuntimeError("SDAR's training attention takes a flex-attention BlockMask built by its own "
                               "SFT forward")
        mask = mask.bool() if mask is not None else None  # :571: an additive 0/-inf mask is inverted
        if mask is None or torch.all(mask):  # :573 "decoding": flash-attn, no mask; (B, T, H, Dh) layout
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return flash_attn_func(q, k, v, causal=False).transpose(1, 2)
        if k.size(1) != q.size(1):  # grouped heads, repeated
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # :585 "prefilling"


class SDARDecoderLayer(GradientCheckpointingLayer, _QwenLayer):
    """modeling_sdar.py:600: Qwen3's names."""

    def __init__(self, c, layer_idx=0):
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.intermediate_size, c.rms_norm_eps, False, norm=SDARRMSNorm, attention=SDARAttention(c))
        self.layer_idx = layer_idx

    def attend(self, q, k, v, mask):
        return self.self_attn.attend(q, k, v, mask)

    def _qk_norm(self, q, k):  # (B, T, H, Dh): per head
        return self.self_attn.q_norm(q), self.self_attn.k_norm(k)

    def forward(self, x, cos, sin, mask, past_key_value=None, store_kv=False):
        def kv(k, v):  # modeling_sdar.py:545-555, after RoPE
            if past_key_value is not None and store_kv:  # append the new keys, attend to all
                return past_key_value.update(k, v, self.layer_idx)
            if past_key_value is not None and len(past_key_value) > self.layer_idx:  # attend, store nothing
                past_k, past_v = past_key_value[self.layer_idx]
                return torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
            return k, v

        return _QwenLayer.forward(self, x, cos, sin, mask, kv)


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    _no_split_modules = ["SDARDecoderLayer"]  # modeling_sdar.py:669
    supports_gradient_checkpointing = True
    _supports_sdpa = True


class SDARModel(SDARPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # modeling_sdar.py: ROPE_INIT_FUNCTIONS["default"], gone in transformers 5 (module docstring)
        self.register_buffer("inv_freq", _inv_freq(config.rope_theta, config.head_dim), persistent=False)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                store_kv=None, cache_position=None):
        B, T = input_ids.shape
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and past_key_values is None:  # modeling_sdar.py:799
            past_key_values = DynamicCache()
        if position_ids is None:  # :802-810: after the cached tokens
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(seen, seen + T, device=input_ids.device)[None]
        cos, sin = _cos_sin(self.inv_freq, position_ids.expand(B, T))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:  # the mask passed on as given: no _update_causal_mask (:812)
            x = layer(x, cos, sin, attention_mask, past_key_values if use_cache else None, store_kv)
        return self.norm(x)


class SDARForCausalLM(SDARPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                cache_position=None, logits_to_keep=0, **kwargs):
        if self.training:  # its block-diffusion SFT: noises input_ids itself, returns only a loss
            assert labels is not None, "Labels must be provided for training."
            raise NotImplementedError("the stand-in does not reproduce SDAR's SFT loss")
        h = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache, **kwargs)  # :1187
        return CausalLMOutputWithPast(logits=self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h))
