"""Models behind one policy interface (SPEC §5)."""

from stabledrl.models.policy import Policy, TinyPolicy, load_policy
from stabledrl.models.tiny import TinyDiffusionConfig, TinyDiffusionLM

__all__ = ["Policy", "TinyPolicy", "load_policy", "TinyDiffusionConfig", "TinyDiffusionLM"]
