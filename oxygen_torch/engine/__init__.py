"""The multi-task engine: concurrent generate() calls on one model merged step by step, a
weighted-fair scheduler with priorities, and admission instead of out-of-memory. Framework-
agnostic: the transformers side (what a step's forward is) lives in integrations/hf/batched.py."""

from .scheduler import KVBudgetError, StepScheduler
from .task import Task, current, task

__all__ = ["KVBudgetError", "StepScheduler", "Task", "current", "task"]
