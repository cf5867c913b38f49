"""The multi-task engine: one thread per model and KV pool owns the loop of every generate()
call it takes (loop.py), a weighted-fair policy with priorities, admission and preemption
instead of out-of-memory; and the per-call path's step scheduler (scheduler.py) for the calls it
does not take. Framework-agnostic: the transformers side lives in integrations/hf/
(engine_runner.py, front.py; batched.py for the per-call path)."""

from .loop import Engine
from .scheduler import KVBudgetError, StepScheduler
from .task import Cancelled, Task, current, task

__all__ = ["Cancelled", "Engine", "KVBudgetError", "StepScheduler", "Task", "current", "task"]
