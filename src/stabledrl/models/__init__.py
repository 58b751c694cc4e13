"""Models behind one policy interface (docs/methods.md, "Policy interface")."""

from stabledrl.models.attention import (
    PROMPT_ATTENTION,
    block_causal_attention_mask,
    block_causal_mask,
    block_ids,
    block_slices,
    staircase_attention_mask,
    staircase_inputs,
    staircase_mask,
    staircase_position_ids,
)
from stabledrl.models.adapters import ADAPTERS, HFPolicy, load_hf_policy
from stabledrl.models.lora import LoraSettings, add_lora, base_policy
from stabledrl.models.native import NATIVE_MODELS, DreamModel, LLaDAModelLM, SDARForCausalLM
from stabledrl.models.policy import ModelConfig, Policy, TinyPolicy, load_policy, resolve_adapter
from stabledrl.models.tiny import KVCache, TinyDiffusionConfig, TinyDiffusionLM

__all__ = [
    "Policy",
    "TinyPolicy",
    "load_policy",
    "ModelConfig",
    "resolve_adapter",
    "ADAPTERS",
    "HFPolicy",
    "load_hf_policy",
    "NATIVE_MODELS",
    "LLaDAModelLM",
    "DreamModel",
    "SDARForCausalLM",
    "LoraSettings",
    "add_lora",
    "base_policy",
    "TinyDiffusionConfig",
    "TinyDiffusionLM",
    "KVCache",
    "block_slices",
    "block_causal_mask",
    "staircase_mask",
    "block_causal_attention_mask",
    "staircase_attention_mask",
    "staircase_position_ids",
    "PROMPT_ATTENTION",
    "block_ids",
    "staircase_inputs",
]
