"""oxygen::paged_step: one layer of a decode step, as compiled decode graphs call it.

``oxygen::paged_step(q, k, v, layer, scale, sliding_window)`` stores the step's K/V and attends over
the paged cache of the decode step running on this thread (the step context's lent core). The
cache is the op's state, not an argument, as in vLLM's attention ops: a compiled graph holds no
cache tensor and no guard on the cache's host state, and the block table, lengths and slots it
reads are the decode graph's buffers. It runs the same code as the eager path
(``PagedKVCore.step``), so every path runs the same kernels; it does not synchronise with the
host, so a step is capturable in a CUDA graph.

Its K/V store is a side effect the op's schema does not declare (mutates_args is empty: the
cache is no argument), so a compiled graph must use every layer's output: one whose result a
compiler can prove empty drops the layers as dead code, their stores with them (a prefill chunk
that kept no logit did on the CPU: HFRunner._compiled keeps two at least).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import context


@torch.library.custom_op("oxygen::paged_step", mutates_args=())
def paged_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    scale: float | None = None,
    sliding_window: int = 0,
) -> Tensor:
    """q: [B, Hq, q, D], k/v: [B, Hkv, q, D] -> [B, q, Hq, D] (q is 1 in a single call's
    decode graph; B is 1 in an engine's merged one, its rows' tokens packed): stores k/v at this
    step's slots of the running decode-graph step's cache (oxygen_torch.context.lent_core) and
    attends over it. sliding_window 0 = none."""
    core = context.lent_core()
    return core.step(layer, q, k, v, scale=scale, sliding_window=sliding_window or None)


@paged_step.register_fake
def _paged_step_fake(q, k, v, layer, scale=None, sliding_window=0):
    # [B, q, Hq, D]: q is 1 in a single call's decode graph; an engine's merged decode graph
    # packs its R rows' tokens into one sequence ([1, Hq, R, D] -> [1, R, Hq, D])
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
