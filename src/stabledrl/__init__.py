"""stabledrl: reinforcement-learning post-training for diffusion language models.

Components (`models`, `sampling`, `likelihood`, `objectives`, `tasks`, `data`,
`diagnostics`, `checkpoint`, `sandbox`) are importable on their own and import no loop;
two loops wire them, `train` (RL) and `sft`, and the `stabledrl` command (`cli`) runs
the loops. The names below are imported on first use, so that `stabledrl.config` and
`stabledrl.settings` load without torch.
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
