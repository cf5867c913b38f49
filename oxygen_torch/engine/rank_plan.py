"""Steps agreed across the ranks of a tensor-parallel model: the step scheduler's coordinator.

Every rank of a tensor-parallel model must run the same forwards in the same order, or their
collectives pair up wrongly and hang. Which calls a merged step takes depends on when each
thread's call arrives, which differs from rank to rank, so under tensor parallelism rank 0
chooses every step and the others run what it chose (engine/scheduler.py). The plans go over a
gloo group of every rank, made once per process at its first coordinated call (every rank gets
there at the same point of the same program), with `broadcast_object_list`: a few hundred bytes a
step, on the host, whatever backend the model's own collectives use.

Coordinated steps need the model's tensor-parallel group to be every rank (`torchrun
--nproc-per-node N` with `tp_plan="auto"`); a model sharded over part of the ranks (data
parallel x tensor parallel) is not coordinated: its calls run one by one, with one warning.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=10)  # a rank waiting this long for a plan fails

_group = None
_lock = threading.Lock()


def tp_size(model) -> int:
    return getattr(model, "tp_size", None) or 1


def unsupported(model) -> str | None:
    """Why the calls of a tensor-parallel `model` cannot have agreed steps (None: they can)."""
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized"
    if dist.get_world_size() != tp_size(model):
        return (
            f"its tensor-parallel group ({tp_size(model)} ranks) is not every rank "
            f"({dist.get_world_size()})"
        )
    return None


class RankPlan:
    """The scheduler's coordinator: rank 0 publishes each step's plan, the others receive it."""

    def __init__(self, group):
        self.group = group
        self.leader = dist.get_rank(group) == 0
        self._src = dist.get_global_rank(group, 0)

    def publish(self, plan: dict) -> None:
        dist.broadcast_object_list([plan], src=self._src, group=self.group)

    def receive(self) -> dict:
        box = [None]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]


def coordinator() -> RankPlan:
    """The process's coordinator over every rank (its group made on first use)."""
    global _group
    with _lock:
        if _group is None:
            _group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        return RankPlan(_group)
