"""torch.compile backend "oxygen": attention rewritten to oxygen's ops at compile time, the rest
compiled by Inductor, optional CUDA graphs per input signature. Registered when oxygen_torch is
imported (`register()` is idempotent).

    compiled = torch.compile(model, backend="oxygen", options={"precision": "auto_mixed"})
    oxygen_torch.compile.stats()   # graphs compiled, attention found / rewritten / left (why)
"""

from ..kv import ops as _kv_ops  # noqa: F401  (oxygen::paged_step, left alone by the passes)
from . import ops as _ops  # noqa: F401  (registers oxygen::attention, which the passes emit)
from .backend import (
    AttentionLeftWarning,
    UnsupportedAttentionError,
    make_backend,
    oxygen_backend,
    register,
)
from .options import CompileOptions
from .stats import reset_stats, stats

register()

__all__ = [
    "register",
    "stats",
    "reset_stats",
    "make_backend",
    "oxygen_backend",
    "CompileOptions",
    "UnsupportedAttentionError",
    "AttentionLeftWarning",
]
