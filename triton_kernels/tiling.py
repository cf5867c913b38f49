"""Tile sizes and launch parameters of the attention kernels.

`select_block_size` starts from the seed's rule — dense attention (128, 128) when hidden >= 2048
else (64, 64), MoE (32, 32), otherwise (64, 64) — and refines it:

- phase "decode": block_m becomes the GQA group padded to a power of two >= 16 (tl.dot's minimum
  M; capped at 64, larger groups are split over programs) and block_n, the key tile, is clamped to
  [64, 128] for 2-byte storage: a decode step is a stream over K/V, and Hopper needs 8-16 KiB
  of K+V in flight per stage to approach HBM bandwidth. fp8 storage takes 64-key tiles in both
  phases (its codes are decoded in registers: see select_block_size).
- registers: the fp32 output accumulator block_m x head_dim stays <= 128 x 128 (head_dim 256
  halves block_m).
- shared memory: the pipelined K and V tiles (num_stages copies each), the Q tile and, for fp8,
  the K/V tiles converted to half must fit SMEM_BUDGET (180 KiB of 227); block_n is halved first
  (down to 32), then block_m. This shrinks tiles for head_dim 256 and for fp32 storage (or
  FP32_SAFE compute). Half-precision prefill takes two stages instead where that keeps the seed
  tile whole (head dims 80-128: (128, 128) at two stages, 1.08-1.15x (128, 64) at three on an
  H100).
- FP32_SAFE: block_n <= 32 (and block_m <= 64 in prefill) with 8 warps: its ieee dots run on
  FMA units out of registers.
- seq_len: no decode tile is larger than the next power of two of the sequence (>= 16). Prefill
  tiles are not capped by the query's length: each cap is a compile of its own (0.5-1.3 s on
  the H200), paid mid-run whenever a step's new tokens fall under a new power of two, for less
  masked work than that costs.
- overrides block_m / block_n are used as given (they must be powers of two >= 16); their
  launch takes fewer pipeline stages where the tiles would not fit the shared-memory budget.

`Tiles` carries a caller's overrides (KernelConfig / model profiles) to the paged kernels.
Choices are memoised per shape bucket (`launch_config`), so a decode step never re-selects; an
autotuner (see benchmarks/bench_attention.py) may store its winner with `record_choice`;
`choices()` shows what was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .precision import PrecisionMode

PHASES = ("decode", "prefill")
ATTENTION_TYPES = ("dense", "moe", "sliding")
# 180 KiB of the H100/H200's 227 KiB per block: the rest is left to layout conversions and the
# reduction scratch the compiler allocates.
SMEM_BUDGET = 180 * 1024
H200_SMS = 132


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


def _check_side(name: str, value, optional: bool = True) -> None:
    """A tile side: a power of two in [16, 256] (tl.dot's minimum is 16), or None if optional."""
    if value is None and optional:
        return
    if not (_is_pow2(value) and 16 <= value <= 256):
        raise ValueError(f"{name}: {value!r} must be a power of two in [16, 256]")


@dataclass(frozen=True)
class Tiles:
    """Tile overrides a caller passes to the paged kernels (from KernelConfig and model profiles).

    block_m: the query tile of prefill. Decode ignores it: its query tile is the GQA group
    (padded to a power of two >= 16), fixed by the head counts.
    block_n: the key tile of decode and prefill.
    attention_type: the seed rule's model kind ("dense", "moe", "sliding"); a call with a
    sliding window on "dense" tiles is tiled as "sliding".
    None leaves a side to `select_block_size`.
    balance: decode cuts the key work into chunks of about equal size from the lengths on the
    device (paged_decode's balanced mode; kernel.decode_balance) instead of the same number of
    splits for every row.
    """

    block_m: int | None = None
    block_n: int | None = None
    attention_type: str = "dense"
    balance: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            _check_side(f"tiles.{name}", getattr(self, name))
        if not isinstance(self.balance, bool):
            raise ValueError(f"tiles.balance: {self.balance!r} must be True or False")
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"tiles.attention_type: {self.attention_type!r} not one of {ATTENTION_TYPES}"
            )

    def kind(self, window: int) -> str:
        """The attention_type of a call with sliding window `window` (0 = none)."""
        return "sliding" if window and self.attention_type == "dense" else self.attention_type


@dataclass(frozen=True)
class TileQuery:
    """What the tile choice depends on. dtype is the KV storage dtype (uint8 = fp8 codes)."""

    hidden_size: int
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    dtype: torch.dtype = torch.bfloat16
    phase: str = "prefill"
    seq_len: int = 2048
    attention_type: str = "dense"
    block_m: int | None = None
    block_n: int | None = None
    precision: PrecisionMode = PrecisionMode.AUTO_MIXED

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "num_q_heads", "num_kv_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: {value!r} must be a positive int")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads: {self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.phase not in PHASES:
            raise ValueError(f"phase: {self.phase!r} not one of {PHASES}")
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"attention_type: {self.attention_type!r} not one of {ATTENTION_TYPES}"
            )
        for name in ("block_m", "block_n"):
            _check_side(name, getattr(self, name))
        object.__setattr__(self, "precision", PrecisionMode.parse(self.precision))

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the tiles held in shared memory and registers."""
        if self.precision == PrecisionMode.FP32_SAFE:
            return 4
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs besides the tensors. num_splits=None: pick from the grid."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None
    # fp8 KV: codes loaded as int32 words and decoded with integer operations (True), or as
    # bytes converted by Triton (False, the earlier path: both kept until the H200 has timed
    # them in one run, bench_attention.py)
    fp8_words: bool = True
    # fp8 KV decode: the next key tile's codes and scales loaded straight into registers
    # (ld.global) before this tile is decoded and computed, instead of Triton's pipeline, which
    # stages them through shared memory (cp.async, num_stages deep) before the integer decode
    # reads them back; an alternative to time (bench_attention.py), not known to be faster.
    # bf16 tiles and prefill ignore it
    fp8_prefetch: bool = False

    def __post_init__(self):
        for name in ("fp8_words", "fp8_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: {getattr(self, name)!r} must be a bool")
        for name in ("block_m", "block_n"):
            _check_side(name, getattr(self, name), optional=False)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: {self.num_warps!r} must be 1, 2, 4, 8 or 16")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages: {self.num_stages!r} must be an int in [1, 6]")
        if self.num_splits is not None and not (
            isinstance(self.num_splits, int) and 1 <= self.num_splits <= 1024
        ):
            raise ValueError(f"num_splits: {self.num_splits!r} must be an int in [1, 1024]")


def check_overrides(launch, tiles) -> Tiles:
    """`launch` (a whole LaunchConfig) or `tiles` (sides for the rule), not both; the Tiles."""
    if launch is not None:
        if not isinstance(launch, LaunchConfig):
            raise ValueError(f"launch: expected a LaunchConfig, got {type(launch).__name__}")
        if tiles is not None:
            raise ValueError("tiles: given together with launch, which fixes the tiles itself")
    if tiles is None:
        return Tiles()
    if not isinstance(tiles, Tiles):
        raise ValueError(f"tiles: expected a Tiles, got {type(tiles).__name__}")
    return tiles


def base_block_size(q: TileQuery) -> tuple[int, int]:
    """The seed's rule, unrefined."""
    if q.attention_type == "dense":
        return (128, 128) if q.hidden_size >= 2048 else (64, 64)
    if q.attention_type == "moe":
        return (32, 32)
    return (64, 64)


def _accumulator_cap(q: TileQuery, block_m: int) -> int:
    """block_m halved until the fp32 accumulator [block_m, D] is <= 128 x 128: 64 registers a
    thread at 8 warps."""
    while block_m * next_pow2(q.head_dim) > 128 * 128 and block_m > 16:
        block_m //= 2
    return block_m


def select_num_stages(q: TileQuery) -> int:
    # head_dim 256 tiles are large: two stages already cover the load latency.
    if next_pow2(q.head_dim) >= 256 or q.elem_bytes == 4:
        return 2
    if q.phase == "prefill" and q.elem_bytes == 2 and q.block_n is None:
        # half-precision prefill whose seed tile does not fit SMEM_BUDGET at three stages (head
        # dims 80-128 at 128 x 128): two stages of the whole key tile, not three of half of it.
        # H100, bench_attention.py --prefill-sweep, bf16 D=128, 2026-12-07: (128, 128) at 2
        # stages 329.8 / 340.2 / 367.4 / 370.0 TFLOP/s against (128, 64) at 3 stages' 306.4 /
        # 311.4 / 318.7 / 322.7 (B=4 S=4096 and B=1 S=16384, block_tokens 16 / 64)
        block_m, block_n = base_block_size(q)
        block_m = q.block_m or _accumulator_cap(q, block_m)  # (a caller's block_m decides)
        if (_smem_bytes(q, block_m, block_n, 3) > SMEM_BUDGET
                >= _smem_bytes(q, block_m, block_n, 2)):  # fmt: skip
            return 2
    return 3


def _smem_bytes(q: TileQuery, block_m: int, block_n: int, stages: int) -> int:
    """Shared memory of one program: the Q tile, `stages` pipelined K and V tiles in storage
    precision, and for fp8 the K and V tiles converted to half for the dots (wgmma reads its B
    operand from shared memory)."""
    d = next_pow2(q.head_dim)
    store = q.elem_bytes
    compute = max(2, store)
    converted = 2 * block_n * d * compute if store < compute else 0
    return block_m * d * compute + stages * 2 * block_n * d * store + converted


def select_block_size(q: TileQuery) -> tuple[int, int]:
    """(block_m, block_n) for `q`; see the module docstring for the rule."""
    block_m, block_n = base_block_size(q)
    if q.phase == "decode":
        block_m = min(64, max(16, next_pow2(q.group)))
        if q.elem_bytes <= 2:
            block_n = min(128, max(64, block_n))
    block_m = _accumulator_cap(q, block_m)
    stages = select_num_stages(q)
    while _smem_bytes(q, block_m, block_n, stages) > SMEM_BUDGET and block_n > 32:
        block_n //= 2
    while _smem_bytes(q, block_m, block_n, stages) > SMEM_BUDGET and block_m > 16:
        block_m //= 2
    if q.elem_bytes == 1:
        # fp8 K/V decoded in registers. Prefill: 128-key tiles spill (sm_90). Decode: 64-key
        # tiles of 4 warps took 0.38 ms against 0.54 for 128 keys of 8 warps (H200, B=8
        # L=32768, 2026-12-05)
        block_n = min(block_n, 64)
    if q.precision == PrecisionMode.FP32_SAFE:
        # ieee fp32 dots run on FMA units from registers: sm_90 builds of larger tiles spill
        # kilobytes per thread (ptxas), so the safe mode takes small tiles
        block_n = min(block_n, 32)
        block_m = block_m if q.phase == "decode" else min(block_m, 64)
    if q.phase == "decode":
        block_n = min(block_n, max(16, next_pow2(q.seq_len)))
    return (q.block_m or block_m, q.block_n or block_n)


def select_num_warps(q: TileQuery, block_m: int, block_n: int) -> int:
    """8 warps where one program's tiles are large, else 4: more warps share the register file.

    Measured with sm_90 builds (ptxas -v): fp8 decode at 128 x 128 K/V tiles needs 255 registers
    and spills at 4 warps, 216 without spills at 8; prefill at head_dim 256 (64 x 64 tiles)
    spills at 4 warps; FP32_SAFE spills least at 8."""
    if q.precision == PrecisionMode.FP32_SAFE:
        return 8
    if q.phase == "prefill" and (
        block_m * block_n >= 128 * 64 or block_m * next_pow2(q.head_dim) >= 128 * 128
    ):
        return 8
    if q.phase == "decode" and block_n * next_pow2(q.head_dim) >= 128 * 128:
        return 8
    return 4


def select_num_splits(
    programs: int, max_seq_len: int, block_n: int, num_sms: int = H200_SMS
) -> int:
    """Splits along the sequence so that programs x splits >= 2 x SMs, each split keeping at
    least 4 key tiles of work (fewer tiles leave the pipeline mostly prologue)."""
    if programs >= 2 * num_sms:
        return 1
    wanted = -(-2 * num_sms // max(programs, 1))
    most = max(1, max_seq_len // (4 * block_n))
    return max(1, min(wanted, most, 256))


_CHOICES: dict[tuple, LaunchConfig] = {}


def bucket(q: TileQuery) -> tuple:
    """The memo key: exact on everything but the sequence length (next power of two)."""
    return (
        q.phase,
        q.attention_type,
        q.hidden_size >= 2048,
        q.head_dim,
        q.group,
        str(q.dtype),
        int(q.precision),
        next_pow2(q.seq_len),
        q.block_m,
        q.block_n,
    )


def launch_config(q: TileQuery) -> LaunchConfig:
    """The memoised launch choice for `q`'s bucket (num_splits left to the caller's grid)."""
    key = bucket(q)
    cfg = _CHOICES.get(key)
    if cfg is None:
        block_m, block_n = select_block_size(q)
        stages = select_num_stages(q)
        if q.block_m or q.block_n:
            stages = _fit_stages(q, block_m, block_n, stages)
        cfg = LaunchConfig(block_m, block_n, select_num_warps(q, block_m, block_n), stages)
        _CHOICES[key] = cfg
    return cfg


def _fit_stages(q: TileQuery, block_m: int, block_n: int, stages: int) -> int:
    """Pipeline stages for overridden tiles: fewer until they fit SMEM_BUDGET (the rule's own
    tiles fit by construction); tiles that fit at no depth are refused here, on the host,
    rather than by the GPU launch."""
    while stages > 1 and _smem_bytes(q, block_m, block_n, stages) > SMEM_BUDGET:
        stages -= 1
    need = _smem_bytes(q, block_m, block_n, stages)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"block_m/block_n: tiles ({block_m}, {block_n}) at head_dim {q.head_dim} "
            f"({q.dtype}, {q.phase}) need {need // 1024} KiB of shared memory, over the "
            f"{SMEM_BUDGET // 1024} KiB budget; use smaller tiles"
        )
    return stages


def record_choice(q: TileQuery, cfg: LaunchConfig) -> None:
    """Store an autotuned choice for `q`'s bucket; later launches in the bucket use it."""
    _CHOICES[bucket(q)] = replace(cfg)


def choices() -> dict[tuple, LaunchConfig]:
    """A copy of the memo: bucket (see `bucket`) -> the launch choice made or recorded there."""
    return dict(_CHOICES)


def clear_choices() -> None:
    _CHOICES.clear()
