"""Data: examples, the task registry (local files, math, reasoning-gym, quickstart) and the prompt sampler."""

from logra_rl.data.config import DataConfig
from logra_rl.data.prompts import Prompt, Workload, load_workload
from logra_rl.data.sampler import PromptSampler
from logra_rl.data.task import Example, Task, load_task, register_task

__all__ = [
    "DataConfig",
    "Example",
    "Prompt",
    "PromptSampler",
    "Task",
    "Workload",
    "load_task",
    "load_workload",
    "register_task",
]
