"""Inductor's CUDA graphs while the oxygen pool is PyTorch's allocator.

CUDA-graph trees need ``checkPoolLiveAllocations`` and allocator checkpoints, which a
``CUDAPluggableAllocator`` lacks (H200: ``mode="reduce-overhead"`` failed there). While the pool is
installed, Inductor's non-tree graphs run instead, captured by the oxygen backend's runner
(``cudagraphs.inductor_cudagraphify``). ``attach()`` / ``detach()`` go through the patch module.
"""

from __future__ import annotations

from .. import _patching
from .cudagraphs import inductor_cudagraphify

GROUP = "compile"


def attach() -> None:
    try:
        import torch._inductor.compile_fx as compile_fx
        import torch._inductor.config as inductor_config
    except Exception:  # inductor unavailable: nothing compiles with cudagraphs anyway
        return
    _patching.replace(
        inductor_config.triton,
        "cudagraph_trees",
        False,
        why="CUDA-graph trees need allocator APIs a pluggable allocator lacks",
        group=GROUP,
    )
    impl = _patching.require(
        compile_fx,
        "cudagraphify_impl",
        library="torch",
        what="Inductor's own CUDA graphs run on the oxygen pool (mode='reduce-overhead' may fail)",
    )
    if callable(impl):
        _patching.replace(
            compile_fx,
            "cudagraphify_impl",
            inductor_cudagraphify,
            why="Inductor's non-tree graphs captured by the oxygen runner (outputs cloned)",
            group=GROUP,
        )


def detach() -> None:
    _patching.undo(GROUP)
