"""stabledrl: reinforcement-learning post-training for diffusion language models.

Components (`models`, `sampling`, `tasks`, `data`) are importable on their own; the
`sft` loop and the `stabledrl` command wire them. The names below are imported on first
use, so that `stabledrl.config` and `stabledrl.settings` load without torch.
"""

import importlib

__all__ = ["TinyDiffusionLM", "load_policy", "generate", "get_task"]
__version__ = "0.1.0"

_HOME = {"TinyDiffusionLM": "stabledrl.models", "load_policy": "stabledrl.models", "generate": "stabledrl.sampling",
         "get_task": "stabledrl.tasks"}


def __getattr__(name: str):  # PEP 562
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'stabledrl' has no attribute {name!r}")
