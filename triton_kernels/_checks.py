"""Argument validation shared by the kernel entry points.

Every check raises ValueError naming the argument, so a caller (the HF integration, the custom
ops) can surface the message as is. The checks read only shapes, dtypes and devices: no value is
copied to the host, so the decode step stays free of synchronisation and CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp8 KV: the real e4m3 dtype on the GPU; uint8 holding e4m3 codes where torch/Triton lack fp8
# (the CPU interpreter tests).
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)
# head dims of the paged kernels (padded to a power of two inside, with masks); the dense kernel
# takes any head_dim up to the largest (a head row is held in registers)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
MAX_HEAD_DIM = max(SUPPORTED_HEAD_DIMS)
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device}, expected {device} (same device as q/k)")


def check_runnable(name: str, t: torch.Tensor) -> None:
    """Triton needs CUDA tensors, unless the interpreter is on (CPU tests)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{name}: Triton kernels need CUDA tensors, got device {t.device}; on CPU use the float64 "
        "references in oxygen_torch.triton_kernels.reference (or set TRITON_INTERPRET=1 before "
        "importing triton, for tests)"
    )


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """shape entries of None match anything."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: shape {list(t.shape)} does not match expected {want}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}: dtype {t.dtype} not supported; allowed: {names}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, device: torch.device) -> None:
    """k_cache, v_cache: [num_blocks, block_tokens, num_kv_heads, head_dim], same dtype."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_device(name, c, device)
        if c.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dims [num_blocks, block_tokens, num_kv_heads, head_dim], "
                f"got shape {list(c.shape)}"
            )
        check_dtype(name, c, FLOAT_DTYPES + FP8_DTYPES)
        if c.stride(-1) != 1:
            raise ValueError(f"{name}: last dim (head_dim) must be contiguous")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: shape {list(v_cache.shape)} differs from k_cache {list(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache: strides differ from k_cache; allocate both the same way")
    bt, d = k_cache.shape[1], k_cache.shape[3]
    if bt < 16 or bt > 256 or bt & (bt - 1):
        raise ValueError(f"k_cache: block_tokens={bt} must be a power of two in [16, 256]")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"k_cache: head_dim={d} not supported; allowed: {SUPPORTED_HEAD_DIMS}")
    if is_fp8(k_cache.dtype):
        # the kernels load fp8 codes four at a time, as int32 words
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.data_ptr() % 4 or any(st % 4 for st in c.stride()[:3]):
                raise ValueError(
                    f"{name}: an fp8 cache must start on a 4-byte boundary with strides that are "
                    f"multiples of 4 (got strides {list(c.stride())}, address "
                    f"{c.data_ptr():#x})"
                )


def check_scales(k_cache, k_scale, v_scale, device) -> None:
    """fp8 caches need per-block-per-head fp32 scales; other caches must not get any."""
    if not is_fp8(k_cache.dtype):
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name}: given, but the cache dtype {k_cache.dtype} is not fp8")
        return
    shape = (k_cache.shape[0], k_cache.shape[2])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name}: required when the cache is fp8 ({k_cache.dtype})")
        check_device(name, s, device)
        check_shape(name, s, shape)
        check_dtype(name, s, (torch.float32,))
        if not s.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")


def check_tables(block_table, seq_lens, batch: int, device) -> None:
    """block_table: [batch, max_blocks] int32; seq_lens: [batch] int32."""
    check_device("block_table", block_table, device)
    check_device("seq_lens", seq_lens, device)
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table: shape {list(block_table.shape)}, expected [batch={batch}, max_blocks]"
        )
    check_dtype("block_table", block_table, (torch.int32,))
    if block_table.stride(1) != 1:
        raise ValueError("block_table: rows must be contiguous")
    check_shape("seq_lens", seq_lens, (batch,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens: must be contiguous")


def check_query(q, k_cache, ndim_name: str):
    """q: [..., num_q_heads, head_dim] with num_q_heads a multiple of num_kv_heads."""
    check_runnable("q", q)
    if q.dim() != 3:
        raise ValueError(f"q: expected {ndim_name}, got shape {list(q.shape)}")
    check_dtype("q", q, FLOAT_DTYPES)
    if q.stride(-1) != 1:
        raise ValueError("q: last dim (head_dim) must be contiguous")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != d:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's {d}")
    if q.shape[1] % hkv != 0:
        raise ValueError(f"q: num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={hkv}")
    if not is_fp8(k_cache.dtype) and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} differs from q's {q.dtype}")


def check_out(out, like: torch.Tensor):
    if out is None:
        return torch.empty_like(like)
    check_device("out", out, like.device)
    check_shape("out", out, tuple(like.shape))
    if out.dtype != like.dtype:
        raise ValueError(f"out: dtype {out.dtype} differs from q's {like.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("out: last dim must be contiguous")
    return out


def check_window(sliding_window) -> int:
    """Returns the window as an int, 0 meaning none."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window: {sliding_window!r} must be a positive int or None")
    if sliding_window <= 0:
        raise ValueError(f"sliding_window: {sliding_window} must be > 0 (None disables it)")
    return sliding_window


def softmax_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    scale = float(scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale: {scale} must be a finite positive number")
    return scale


def patch_interpreter_scalars() -> None:
    """Let Triton 3.6's interpreter run loops with runtime bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and gives them `__index__` through
    int(array), which NumPy 2.4 turned into a TypeError for ndim > 0 arrays; `range(start, end)`
    over values read in the kernel then fails. Converting the single element instead is what
    NumPy asks for. Applied only when interpreting; the interpreter's own patch scope restores
    it after each launch (LIFO), like its other patches.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter module
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_oxygen_scalar_index", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._oxygen_scalar_index = True
    interpreter._patch_lang_tensor = patched


def as_codes(cache: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn storage as its uint8 codes: the kernels decode the codes with integer
    operations, so the GPU runs the same code path as the CPU interpreter (which has no fp8
    tensors)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
