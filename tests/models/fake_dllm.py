"""Stand-ins for LLaDA's and Dream's own modelling code, loaded as remote code in tests.

The real checkpoints ship their modelling files beside the weights and are loaded with
``AutoModel.from_pretrained(dir, trust_remote_code=True)``; these tiny classes are saved
the same way (config.json's ``auto_map`` names this file, copied into the directory), so
the adapters' real loading path runs without the Hub. Their forward signatures mirror
the originals:

- LLaDA: ``forward(input_ids, attention_mask=None, attention_bias=None, ...)``, a (B, T)
  padding mask, positions counted by the model; logits[:, i] predict token i.
- Dream: ``forward(input_ids, attention_mask=None, position_ids=None, ...)``, a 4-D
  boolean mask; logits[:, i] predict token i + 1 (the autoregressive head's shift).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class FakeLLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(self, vocab_size=32, hidden_size=32, max_position_embeddings=128, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


class FakeDreamConfig(FakeLLaDAConfig):
    model_type = "Dream"

    def __init__(self, **kwargs):  # transformers turns a config subclass without __init__ into a dataclass
        super().__init__(**kwargs)


class _Core(nn.Module):
    """Embedding + learned positions, one bidirectional attention layer, an MLP, a head."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.pos = nn.Embedding(cfg.max_position_embeddings, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size)

    def forward(self, input_ids, allowed, position_ids):  # allowed: (B, T, T) bool
        x = self.embed(input_ids) + self.pos(position_ids)  # (B, T, D)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=allowed[:, None])[:, 0])
        x = x + self.mlp(x)
        return self.head(self.norm(x))  # (B, T, V), unshifted


class _Base(PreTrainedModel):
    base_model_prefix = "core"

    def __init__(self, config):
        super().__init__(config)
        self.core = _Core(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.2)

    def get_input_embeddings(self):
        return self.core.embed


class FakeLLaDAModelLM(_Base):
    config_class = FakeLLaDAConfig

    def forward(self, input_ids, attention_mask=None, attention_bias=None, use_cache=None, **kwargs):
        B, T = input_ids.shape
        keys = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        allowed = keys[:, None, :].expand(B, T, T) | torch.eye(T, dtype=torch.bool)  # (B, T, T)
        positions = torch.arange(T).expand(B, T)  # LLaDA counts positions itself
        return CausalLMOutputWithPast(logits=self.core(input_ids, allowed, positions))


class FakeDreamModel(_Base):
    config_class = FakeDreamConfig

    def unshifted_logits(self, input_ids, attention_mask, position_ids):
        """What position i predicts for token i (for the test's reference)."""
        return self.core(input_ids, attention_mask[:, 0] | torch.eye(input_ids.size(1), dtype=torch.bool), position_ids)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        if attention_mask is None or attention_mask.dim() != 4:
            raise ValueError("this stand-in takes a 4-D boolean attention mask, as Dream's sampler passes")
        u = self.unshifted_logits(input_ids, attention_mask, position_ids)  # (B, T, V)
        # Dream's head: column i holds the prediction of token i + 1.
        return CausalLMOutputWithPast(logits=torch.cat([u[:, 1:], u[:, -1:]], dim=1))
