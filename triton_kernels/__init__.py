"""Triton kernels of oxygen_torch: paged KV append, paged decode/prefill attention, adaptive
tiling and precision modes. Installed as oxygen_torch.triton_kernels; imports nothing from
oxygen_torch (layers point down). Layouts and conventions: README.md in this directory.

Importing needs triton; on a CPU-only machine the kernels run only under TRITON_INTERPRET=1,
otherwise use the float64 references in `oxygen_torch.triton_kernels.reference`.
"""

from ._checks import MAX_HEAD_DIM, SUPPORTED_HEAD_DIMS, interpreting, patch_interpreter_scalars
from .kv_append import kv_append
from .paged_decode import paged_decode
from .paged_prefill import paged_prefill
from .precision import KV_DTYPES, PrecisionMode
from .reference import (
    dense_attention_ref,
    kv_append_ref,
    paged_decode_ref,
    paged_prefill_ref,
)
from .tiling import (
    LaunchConfig,
    TileQuery,
    Tiles,
    choices,
    launch_config,
    record_choice,
    select_block_size,
    select_num_splits,
    select_num_stages,
    select_num_warps,
)

if interpreting():
    patch_interpreter_scalars()

__all__ = [
    "kv_append",
    "paged_decode",
    "paged_prefill",
    "PrecisionMode",
    "KV_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "MAX_HEAD_DIM",
    "kv_append_ref",
    "paged_decode_ref",
    "paged_prefill_ref",
    "dense_attention_ref",
    "TileQuery",
    "LaunchConfig",
    "Tiles",
    "select_block_size",
    "select_num_warps",
    "select_num_stages",
    "select_num_splits",
    "launch_config",
    "record_choice",
    "choices",
]
