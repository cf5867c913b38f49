"""The transformers integration (see integration.py): the paged Cache, the "oxygen" attention and
mask functions, generate() on the paged cache with decode graphs."""

from .cache import PagedKVCache
from .integration import apply, disable_hf, enable_hf, is_enabled, unsupported_reason, uses_oxygen

__all__ = [
    "PagedKVCache",
    "apply",
    "disable_hf",
    "enable_hf",
    "is_enabled",
    "unsupported_reason",
    "uses_oxygen",
]
