"""stabledrl: reinforcement-learning post-training for diffusion language models.

Components (`models`, `sampling`, `tasks`, `data`) are importable on their own; the
`sft` loop and the `stabledrl` command wire them.
"""

from stabledrl.models import TinyDiffusionLM, load_policy
from stabledrl.sampling import generate
from stabledrl.tasks import get_task

__all__ = ["TinyDiffusionLM", "load_policy", "generate", "get_task"]
__version__ = "0.1.0"
