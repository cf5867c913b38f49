"""The configuration's dataclasses: one per concern, validated where they are built (a bad value
raises ValueError naming the field, the value and what is allowed)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from ..triton_kernels.precision import KV_DTYPES, PrecisionMode
from ..triton_kernels.tiling import ATTENTION_TYPES

log = logging.getLogger("oxygen_torch")

MiB = 1 << 20
GiB = 1 << 30
# 2 MiB: the VMM allocation granularity the driver reports on H100/H200 (and every NVIDIA GPU with
# VMM support so far). The native pool re-checks page_size against the live device at creation.
DEVICE_GRANULARITY = 2 * MiB
# 1 GiB: the largest huge page x86-64 and arm64 have. A page is the pool's unit of mapping, and
# the KV arena needs two per layer at least: a larger one maps most of a GPU for one small tensor
# (page_size=1TiB once got as far as generate(), where the arena refused it blaming kv.arena_bytes).
MAX_PAGE_SIZE = GiB
# 128 TiB: the user address space of x86-64 and arm64 with 4-level page tables; no virtual range
# (kv.arena_bytes) can be larger.
MAX_VIRTUAL_BYTES = 1 << 47
# kv.fresh_prefill: how a prefill with no cached prefix attends (kv/fresh.py)
FRESH_PREFILL = ("auto", "dense", "paged")
TIER_MOVES = ("auto", "gather", "mapped")  # pool.tier_moves (kv/transfer.py way_of)
# Token counts are int32 in the kernels' position and length tensors.
MAX_TOKENS = (1 << 31) - 1
# Integers written with more digits than this are refused before Python converts them (it refuses
# past 4,300 digits with a message that names no field); no field allows a value this long.
_MAX_DIGITS = 40

ENV_CONF = "OXYGEN_CONF"
ENV_FILE = "OXYGEN_CONFIG_FILE"
# 1 MiB: the file ENV_FILE names is read whole; a real one is a few hundred bytes, and a bound
# keeps a wrong path (a log, a disk image) from taking the process's memory
MAX_CONFIG_FILE_BYTES = MiB


def describe(value: Any) -> str:
    """A value as an error message shows it: Python cannot even repr() an int past 4,300 digits,
    and a 5,000-character string is not a message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits (about 2**{value.bit_length() - 1})"
    try:
        text = repr(value)
    except ValueError:  # a container holding such an integer
        return f"a {type(value).__name__} holding an integer too long to print"
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _sized(n: int) -> str:
    """1099511627776 -> '1099511627776 (1 TiB)': what a size error should show."""
    for unit, name in ((1 << 40, "TiB"), (GiB, "GiB"), (MiB, "MiB")):
        if n >= unit and n % unit == 0 and n.bit_length() <= 128:
            return f"{n} ({n // unit} {name})"
    return describe(n)


def _check_ratio(section: str, name: str, value: float) -> None:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"{section}.{name}: {describe(value)} is out of range; allowed: (0, 1]")


def _check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name}: {describe(value)} is not allowed; allowed: {', '.join(allowed)}"
        )


def _check_int(where: str, value: int, lo: int, hi: int, allowed: str) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {_sized(value)} is out of range; allowed: {allowed}")


def check_page_size(where: str, value: int) -> None:
    """pool.page_size's rule, shared with the pool objects (pool/objects.py), whose host backend
    must refuse what the device would: a positive multiple of 2 MiB, at most 1 GiB."""
    if value <= 0 or value % DEVICE_GRANULARITY:
        raise ValueError(
            f"{where}: {describe(value)} is not a positive multiple of the device "
            f"granularity ({DEVICE_GRANULARITY} bytes = 2 MiB)"
        )
    _check_int(where, value, 1, MAX_PAGE_SIZE, "a multiple of 2 MiB up to 1 GiB")


def host_memory_bytes() -> int:
    """This machine's physical memory (the bound of the pinned CPU tier), or the address space
    when the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return MAX_VIRTUAL_BYTES


def default_cpu_tier_bytes() -> int:
    """pool.cpu_tier_bytes by default: 4 GiB, or an eighth of this machine's memory when that is
    less (whole MiB). The tier is made (and pinned) at the first preemption or cold prefix block
    that needs it (the engine on a GPU: by a thread beside its steps), or by warm_up(), never
    at enable()."""
    return min(4 * GiB, host_memory_bytes() // 8) // MiB * MiB


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_types(obj: Any, section: str) -> None:
    """Direct construction (PoolConfig(page_size="2MiB")) gets the same clear error as parsing."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        value = getattr(obj, name)
        allowed = tuple(t for t in (typing.get_args(hint) or (hint,)))
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        else:
            ok = isinstance(value, allowed)
        if not ok:
            names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(
                f"{section}.{name}: {describe(value)} has the wrong type; allowed: {names}"
            )


@dataclass(frozen=True)
class PoolConfig:
    """The VMM pool (csrc/page_pool)."""

    page_size: int = 2 * MiB  # a multiple of 2 MiB, at most 1 GiB
    # The zones of a pool with a CPU tier and a prefix cache: when its device KV use (blocks
    # used / blocks) passes migration_threshold, the coldest blocks only the prefix cache holds
    # move to the tier until use is at most hot_zone_ratio (seed design's 0.6 / 0.8)
    hot_zone_ratio: float = 0.6
    migration_threshold: float = 0.8
    # host bytes for the KV CPU tier (pinned on a GPU): the engine's preempted calls swap their
    # KV there instead of being recomputed; 0 = no tier; at most host memory. By default 4 GiB
    # or an eighth of host memory, whichever is less, pinned only when first needed
    cpu_tier_bytes: int = field(default_factory=default_cpu_tier_bytes)
    # a directory on local NVMe for a disk tier behind the CPU tier (one preallocated file of
    # pool.disk_tier_bytes, removed when the pool closes): when the CPU tier is full its least
    # recently used blocks move there; "" = no disk tier
    disk_tier_path: str = ""
    disk_tier_bytes: int = 0
    # under pressure (the CPU tier more than 75 % full), low-priority calls' swapped-out KV is
    # stored as fp8 e4m3 with per-head scales (16-bit pools): half the bytes, but the tokens
    # may change, so off by default
    tier_fp8_lowering: bool = False
    # how the CPU tier's moves reach the host rows: "gather" (kernels gather the blocks into a
    # staging buffer, the copy engine copies it across, paced a piece at a time), "mapped" (one
    # kernel of a few programs reads the blocks and stores them into the pinned rows through
    # their device address: no copy engine, a smaller share of PCIe), "auto" (on a GPU, moves down
    # while decode steps run there mapped, every other move gather; on the host backend gather).
    # Measured on the H200: kv/transfer.py's docstring
    tier_moves: str = "auto"
    reserve_fraction: float = 0.9  # share of device memory reserved as one virtual range
    # auto: cuda when a driver and device exist, else host; cuda asked for on a machine without a
    # usable GPU is an error at enable(), never a quiet switch to host
    backend: str = "auto"
    # How long a page with nothing live stays mapped before it is unmapped (global pool). 20 ms
    # spans a decode step, so the step's transients (logits, sampling buffers) find their pages
    # still mapped: the H200 generate() trace replayed at its real pace maps 38 pages a step at
    # 20 ms against 70 at 2 ms, with the same fragmentation and nothing held 100 ms after
    # (benchmarks/replay_hysteresis.py); a map + unmap costs ~96 us on the H200. While allocations
    # keep coming, idle pages within the live bytes' recent peak stay past it (csrc
    # allocator_pages.cpp keep_pages)
    hysteresis_ms: float = 20.0
    # A block that needs pages past the peak of live bytes while idle pages (mapped, nothing
    # live) wait out their hysteresis elsewhere takes their physical pages ("lends" them: one
    # map each at the new address) instead of mapping new ones: mapped bytes stay near the live
    # peak. Below that peak new pages are mapped and the idle ones stay where the next blocks
    # sit on them. Replays of the recorded traces (benchmarks/replay_allocs.py, 20 ms): the
    # generate() trace 4,861 maps at 0.9 % fragmentation (lending every page: 12,134 at 1.08 %;
    # off: 4,717 at 7.6 %), the engine's 256-row trace ~440 at 1.9-2.1 %
    lend_idle_pages: bool = True

    def __post_init__(self):
        _check_types(self, "pool")
        if not 0.01 <= self.hysteresis_ms <= 60000:
            raise ValueError(
                f"pool.hysteresis_ms: {describe(self.hysteresis_ms)} is out of range; allowed: "
                "0.01 to 60000 (milliseconds)"
            )
        check_page_size("pool.page_size", self.page_size)
        _check_ratio("pool", "hot_zone_ratio", self.hot_zone_ratio)
        _check_ratio("pool", "migration_threshold", self.migration_threshold)
        if self.hot_zone_ratio > self.migration_threshold:
            raise ValueError(
                f"pool.hot_zone_ratio: {describe(self.hot_zone_ratio)} is above "
                f"pool.migration_threshold {describe(self.migration_threshold)}; allowed: at most "
                "the threshold (the sweep moves blocks down from the threshold to the ratio)"
            )
        _check_ratio("pool", "reserve_fraction", self.reserve_fraction)
        if self.cpu_tier_bytes < 0:
            raise ValueError(
                f"pool.cpu_tier_bytes: {describe(self.cpu_tier_bytes)} is negative; allowed: ≥ 0"
            )
        ram = host_memory_bytes()
        _check_int(
            "pool.cpu_tier_bytes",
            self.cpu_tier_bytes,
            0,
            ram,
            f"0 to this machine's memory, {ram} bytes ({ram / GiB:.1f} GiB)",
        )
        _check_choice("pool", "backend", self.backend, ("auto", "cuda", "host"))
        _check_choice("pool", "tier_moves", self.tier_moves, TIER_MOVES)
        _check_disk_tier(self)


def _check_disk_tier(cfg: PoolConfig) -> None:
    """A disk tier needs a CPU tier, a writable directory and room for its file, checked when
    the configuration loads (the file itself is allocated when the tier is made)."""
    path, nbytes = cfg.disk_tier_path, cfg.disk_tier_bytes
    if nbytes < 0:
        raise ValueError(f"pool.disk_tier_bytes: {describe(nbytes)} is negative; allowed: ≥ 0")
    if not path:
        if nbytes:
            raise ValueError(
                f"pool.disk_tier_bytes: {_sized(nbytes)} given without pool.disk_tier_path"
            )
        return
    if not nbytes:
        raise ValueError(f"pool.disk_tier_path: {describe(path)} needs pool.disk_tier_bytes > 0")
    if not cfg.cpu_tier_bytes:
        raise ValueError(
            f"pool.disk_tier_path: {describe(path)} needs a CPU tier (pool.cpu_tier_bytes > 0)"
        )
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"pool.disk_tier_path: {describe(path)} is not a writable directory")
    st = os.statvfs(path)
    if nbytes > st.f_bavail * st.f_frsize:
        raise ValueError(
            f"pool.disk_tier_bytes: {_sized(nbytes)} is more than the "
            f"{st.f_bavail * st.f_frsize} bytes free in pool.disk_tier_path {describe(path)}"
        )


@dataclass(frozen=True)
class KVConfig:
    """The paged KV cache (oxygen_torch/kv)."""

    block_tokens: int = 16  # tokens per KV block; a power of two in [16, 256] (kernel tiles)
    kv_dtype: str = "auto"  # auto: the model's dtype
    # the engine's prefetch: a call swapped out to the CPU tier starts coming back when a step
    # chooses it, and sits out up to this many steps in a row while its copy runs beside the
    # other calls' steps; 0 = its step waits for the copy (integrations/hf/batched.py fetch).
    # Off by default: not yet measured faster end to end on the H200 (docs/operations.md)
    prefetch_distance: int = 0
    # virtual size of the KV arena; 0 = sized from device memory; at most 128 TiB (address space)
    arena_bytes: int = 0
    debug_checks: bool = False  # check block ids against mapped pages before every launch
    # generate() on the paged cache runs a prompt of batch x length > this many tokens in chunks
    # along the sequence (transformers' prefill_chunk_size), so prefill activations stay at this
    # size instead of growing with the prompt; 0 = never chunk; at most 2^31 - 1 (int32 positions)
    prefill_chunk_tokens: int = 16384
    # a prefill with no cached prefix: attention on the forward's own K/V through torch SDPA
    # (dense), over the paged cache (paged), or chosen per call by shape/dtype/device from the
    # measured table in kv/fresh.py (auto); K/V are written to the cache either way
    fresh_prefill: str = "auto"
    # generate() on the paged cache (CUDA) replays its one-token decode steps from CUDA graphs
    decode_graphs: bool = True
    # ... captured from compiled code (fused kernels) rather than the eager forward
    decode_graph_fusion: bool = True
    # ... the whole forward compiled by backend "oxygen" (False: RMSNorm / MLP / rotary only)
    decode_graph_compile: bool = True
    # the engine's steps that carry prompt tokens (the steps no decode graph replays) run the
    # model's forward compiled whole by backend "oxygen" too, with dynamic shapes (one compile
    # for every token count, shared with the decode and mixed graphs: whichever step comes
    # first pays it, alone) instead of eagerly: an eager forward's Python (the H100's arrival
    # trace: 25-47 ms of the engine thread for a 22-layer step, whatever its tokens) is what
    # every decoding row of the step waits for.
    # On a GPU, or on a CPU with cpu_decode_graphs "fuse"; a compile that fails warns once and
    # the steps run eagerly. On since measured on an H100 (benchmarks/RESULTS.md, time to first
    # token): with kv.mixed_graphs 2048 it is the steps over 2,048 prompt tokens, and their
    # first token went from 1.01-1.14x stock's static cache to 0.80-0.81x; the compile (~18 s
    # on that machine) is paid by the first such step, or by oxygen_torch.warm_up()
    prefill_compile: bool = True
    # the engine's steps that carry prompt tokens, up to this many tokens, replay CUDA graphs by
    # (tokens, rows) bucket (integrations/hf/mixed_graphs.py) as its decode steps do: no eager
    # Python for such a step. The graphs share one memory pool (the largest's working memory,
    # each one's logits). 0 = off (those steps eager, or prefill_compile); else 16 to 16,384.
    # On a GPU, or on a CPU with cpu_decode_graphs. On (2,048) since measured on an H100: a
    # 1,024-token prompt's first token 41 -> 11 ms, the arrival trace's high TPOT P99 3.2x lower
    mixed_graphs: int = 2048
    # on a CPU, where there is no CUDA graph: "off", decode graphs on a GPU only; "rerun", the
    # decode-graph path runs all its host bookkeeping and a "replay" runs the captured forward
    # again (the tests of that path, and benchmarks/bench_multitask.py --host-only, which times
    # the engine's host side); "fuse", as "rerun" with the forward fused (compiled whole by
    # backend "oxygen" unless decode_graph_compile is off) as on a GPU. A GPU ignores it
    cpu_decode_graphs: str = "off"
    # generate() keeps the KV blocks of finished prompts (and of the tokens it generated, without
    # beams), found again by token content, so a later call with the same prefix (a system
    # prompt, a chat's earlier turns) skips that part of its prefill
    prefix_cache: bool = False
    # ... holding at most this many bytes of KV (all layers); cold blocks go first (LRU-K), and
    # the cache gives blocks back at once when the pool runs short
    prefix_cache_bytes: int = 256 * MiB
    # the engine's KV pool keeps up to this many bytes of empty pages mapped ahead of its block
    # allocator, mapped (and the pages left empty unmapped) by a thread of the pool's, not by the
    # engine's thread in its steps; they go back 0.1 s after allocations stop; 0 = off
    map_ahead_bytes: int = 256 * MiB
    # a generate() whose rows need more KV than the pool holds (prompt + max_new_tokens per row)
    # runs as groups of rows that fit, merged by the engine, and returns what one call would;
    # False: it runs whole and fails as the pool fills (integrations/hf/oversubscribe.py)
    oversubscribe: bool = True
    # a hybrid model (some layers slide, the others see every token: Gemma-2/3, gpt-oss): the
    # sliding layers' pages of blocks behind every row's window are unmapped, the blocks kept
    # for the full-attention layers (kv/window.py); False: every layer keeps every block
    hybrid_windows: bool = True

    def __post_init__(self):
        _check_types(self, "kv")
        if not (_is_pow2(self.block_tokens) and 16 <= self.block_tokens <= 256):
            raise ValueError(
                f"kv.block_tokens: {describe(self.block_tokens)} is not allowed; "
                "allowed: a power of two from 16 to 256"
            )
        _check_choice("kv", "kv_dtype", self.kv_dtype, tuple(KV_DTYPES))
        _check_choice("kv", "fresh_prefill", self.fresh_prefill, FRESH_PREFILL)
        _check_choice("kv", "cpu_decode_graphs", self.cpu_decode_graphs, ("off", "rerun", "fuse"))
        _check_int("kv.prefetch_distance", self.prefetch_distance, 0, 1024, "0 to 1024")
        _check_int("kv.mixed_graphs", self.mixed_graphs, 0, 16384, "0 (off) or 16 to 16384")
        if 0 < self.mixed_graphs < 16:
            raise ValueError(
                f"kv.mixed_graphs: {self.mixed_graphs} is out of range; allowed: 0 (off) or 16 "
                "to 16384"
            )
        if self.arena_bytes < 0:
            raise ValueError(
                f"kv.arena_bytes: {describe(self.arena_bytes)} is negative; allowed: ≥ 0"
            )
        _check_int(
            "kv.arena_bytes",
            self.arena_bytes,
            0,
            MAX_VIRTUAL_BYTES,
            f"0 (auto) to {MAX_VIRTUAL_BYTES} bytes (128 TiB of address space)",
        )
        _check_int(
            "kv.prefix_cache_bytes",
            self.prefix_cache_bytes,
            0,
            MAX_VIRTUAL_BYTES,
            f"0 to {MAX_VIRTUAL_BYTES} bytes (the KV arena's largest size)",
        )
        _check_int(
            "kv.map_ahead_bytes",
            self.map_ahead_bytes,
            0,
            MAX_VIRTUAL_BYTES,
            f"0 (off) to {MAX_VIRTUAL_BYTES} bytes",
        )
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"kv.prefill_chunk_tokens: {describe(self.prefill_chunk_tokens)} is negative; "
                "allowed: 0 (never chunk) or a token count"
            )
        _check_int(
            "kv.prefill_chunk_tokens",
            self.prefill_chunk_tokens,
            0,
            MAX_TOKENS,
            f"0 (never chunk) to {MAX_TOKENS} tokens",
        )


@dataclass(frozen=True)
class KernelConfig:
    """Attention kernels (triton_kernels)."""

    precision: PrecisionMode = PrecisionMode.AUTO_MIXED
    attention_type: str = "dense"
    block_m: int | None = None  # tile overrides; powers of two (Triton block sides)
    block_n: int | None = None
    # paged decode cuts the key work into chunks of about equal size from the lengths on the
    # device (triton_kernels/paged_decode.py, balanced mode), so one long sequence among short
    # ones does not hold the step: off until bench_attention.py has timed it on the H200 (the
    # classic splits: one 32k row beside 31 of 512 took 0.42 ms against cuDNN's 0.09)
    decode_balance: bool = False
    # a model's q / k / v and gate / up weights laid out as adjacent rows of one buffer each
    # when its first engine is made (same parameters and values, no memory added; transformers'
    # save_pretrained still works), so the compiled forward runs each group as one GEMM
    # (compile/linear_cat.py). The H100 (bench_linear.py, 1B shape, 64 rows): q, k and v 17.2 us
    # apart, 7.4 us as one GEMM; gate and up 28.8 / 26.3 us. Off until a whole engine step has
    # been timed with it (bench_multitask.py)
    fuse_projections: bool = False

    def __post_init__(self):
        object.__setattr__(self, "precision", PrecisionMode.parse(self.precision))
        _check_types(self, "kernel")
        _check_choice("kernel", "attention_type", self.attention_type, ATTENTION_TYPES)
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v is not None and not (_is_pow2(v) and 16 <= v <= 256):
                raise ValueError(
                    f"kernel.{name}: {describe(v)} is not allowed; allowed: a power of two from "
                    "16 to 256 (Triton block sides), or none"
                )


@dataclass(frozen=True)
class SchedulerConfig:
    """The multi-task engine (oxygen_torch/engine): concurrent generate() calls on one model
    merged step by step. Weights of W_i = alpha * QoS_i / Latency_i + beta * Tokens_i /
    CacheSize_i (policy "wfq")."""

    alpha: float = 0.7
    beta: float = 0.3
    merge: bool = True  # merge concurrent generate() calls' forwards on the paged cache
    policy: str = "wfq"  # wfq (weighted fair queuing, the seed's weights) or fcfs
    # tokens one merged step computes at most (decode tokens + prefill chunks); a longer
    # prefill is cut into chunks that fit beside the others' decode tokens
    max_step_tokens: int = 8192
    max_step_seqs: int = 256  # sequences one merged step serves at most
    # while a call of a higher priority level is live (running or waiting), the prefill chunks
    # of lower-level calls take at most this many tokens of a step together, so the higher
    # calls' steps stay short (their time per token) and their prompts start sooner; lower calls
    # still progress every step (never starved); 0 = no such cap. On the H200 (Llama-1.1B
    # shape) a high row's slow steps under a trace were steps that carried a low call's prompt:
    # 28.4 ms at P99 against 4.0 ms with no low load
    lower_prefill_tokens: int = 256
    # while rows of the highest live priority level decode, a step's prefill chunks (every
    # level's) take at most this many tokens together, so those rows' time per token stays near
    # a decode step's even when prompts arrive (a step of max_step_tokens prompt tokens is tens
    # of ms on a 1B model); prompts then start over more steps. 0 = no such cap (the default
    # until measured on a trace)
    decode_prefill_tokens: int = 0
    # how long a step waits for a call that has not submitted yet before it goes without it
    gather_ms: float = 5.0
    # merged decode steps (every row one token) replayed from CUDA graphs by batch-size bucket;
    # off by default until it has run on a GPU (with kv.decode_graphs also on)
    decode_graphs: bool = False
    # the engine owns the loop: a generate() call whose settings it supports becomes engine
    # requests (one thread per model steps every row at once); false: every call runs its own
    # loop, merged step by step as above (the calls the engine does not take always do)
    engine: bool = True
    # the engine's steps run on a CUDA stream of their own: callers' device reads (theirs and
    # the user's own before generate()) do not wait for the steps the engine has queued; the
    # engine and the callers order where they share memory (kv/engine_streams.py). Off: on the
    # H200 at 256 calls at once it gave 25,808 / 29,084 / 26,287 tok/s against the default's
    # 29,866 / 23,909 / 23,524 in the same call (no clear gain; both before gc_freeze)
    engine_stream: bool = False
    # the first engine on a GPU runs a full garbage collection and freezes what survives
    # (gc.freeze), and again after each decode graph compiled (a compile leaves ~10^5
    # long-lived objects): later full collections walk only newer objects instead of every
    # object of torch, transformers, the model and the compiles, a 0.1-0.5 s pause of every
    # thread (engine/gc_watch.py)
    gc_freeze: bool = True
    # while an engine thread runs, the interpreter's switch interval (sys.setswitchinterval) is
    # at most this (ms), then put back: each torch op of a step's launch gives the interpreter
    # lock up, and taking it back behind a thread busy in Python waits that thread's interval
    # (5 ms by default): one such thread beside the engine stretched a decode launch 0.2 -> 60
    # ms on the CPU machine. Shorter is not better: a hundred streaming callers woken a step
    # then take the lock from the engine every interval (0.1 ms: 0.6x the tok/s of the loaded
    # trace on the CPU machine; 2 ms as the interpreter's own; engine/switching.py). 0: leave it
    switch_interval_ms: float = 2.0
    # an idle engine (no row running) with generate() calls on their way in (from their start
    # to their rows' submission) waits while they keep coming: until none has passed for this
    # long, all have come, the calls in hand fill a step, a call above the normal priority is in
    # hand, or 10 times this long has gone by (engine/loop.py, BURST_CAP). A burst's first step
    # then serves many rows, not the first callers' few beside the others' front-door Python
    # (on a GPU: the door applies there; 0: the engine launches at once)
    burst_gather_ms: float = 20.0
    # a streaming generate() call (a streamer: one put a step in stock) is woken for its new
    # tokens at most this often: its first token at once, then the tokens of the steps since
    # its last wake together (one put each, in order), and at its end at once. Each wake is the
    # caller's Python under the interpreter lock beside the engine's launches: hundreds of
    # streams woken every step slow every step. 0: every step (stock's cadence); `serve` uses
    # 10 unless set
    stream_interval_ms: float = 0.0
    # while a call of a higher priority level is live, streaming calls of lower levels are
    # woken at most this often (their steps' tokens together, in order): a hundred streams'
    # callers woken every step hold the interpreter lock the steps the higher calls wait on
    # need (a step of 4 ms with 1 ms of host work stretched to P99 9 / 16 ms beside 100 / 200
    # threads doing 40 us of Python a wake, on the CPU machine). 0: as stream_interval_ms
    lower_stream_interval_ms: float = 0.0
    # how the engine processes and draws a step's sampling rows on a GPU: "torch"
    # (transformers' processors in PyTorch on a float32 copy: top-p sorts every sampling row's
    # vocabulary), "topk" (when every sampling row has a top_k <= 1024 and no row wants its
    # scores: the warpers and the draw over each row's top_k + 64 largest scores, found by a
    # chunk kernel, no sort of the vocabulary; else as "torch"). Elsewhere "torch". "topk"
    # (then with torch.topk over whole rows) took 0.52 / 0.33 / 0.16x
    # "torch"'s time at 1 / 64 / 256 rows of a 128k vocabulary on the H100 (bench_sampling.py),
    # the same tokens but at ties of the bf16 logits. A fused variant (the warpers, top-p by
    # bisection, and the draw in one kernel) was measured slower than both and removed
    sampling_kernel: str = "topk"

    def __post_init__(self):
        _check_types(self, "scheduler")
        _check_choice("scheduler", "sampling_kernel", self.sampling_kernel, ("torch", "topk"))
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0) or math.isnan(v):
                raise ValueError(
                    f"scheduler.{name}: {describe(v)} is out of range; allowed: [0, 1]"
                )
        _check_choice("scheduler", "policy", self.policy, ("wfq", "fcfs"))
        if not 0 <= self.lower_prefill_tokens <= 1 << 20:
            raise ValueError(
                f"scheduler.lower_prefill_tokens: {describe(self.lower_prefill_tokens)} is out "
                "of range; allowed: 0 (no cap) … 1048576"
            )
        if not 0 <= self.decode_prefill_tokens <= 1 << 20:
            raise ValueError(
                f"scheduler.decode_prefill_tokens: {describe(self.decode_prefill_tokens)} is "
                "out of range; allowed: 0 (no cap) … 1048576"
            )
        for name, top in (("max_step_tokens", 1 << 20), ("max_step_seqs", 1 << 16)):
            v = getattr(self, name)
            if not 1 <= v <= top:
                raise ValueError(
                    f"scheduler.{name}: {describe(v)} is out of range; allowed: 1 to {top}"
                )
        if not 0.01 <= self.gather_ms <= 10000 or math.isnan(self.gather_ms):
            raise ValueError(
                f"scheduler.gather_ms: {describe(self.gather_ms)} is out of range; allowed: "
                "0.01 to 10000 (milliseconds)"
            )
        for name in ("stream_interval_ms", "lower_stream_interval_ms"):
            v = getattr(self, name)
            if not 0 <= v <= 10000 or math.isnan(v):
                raise ValueError(
                    f"scheduler.{name}: {describe(v)} is out of range; allowed: 0 to 10000 "
                    "(milliseconds)"
                )
        if not 0 <= self.switch_interval_ms <= 1000 or math.isnan(self.switch_interval_ms):
            raise ValueError(
                f"scheduler.switch_interval_ms: {describe(self.switch_interval_ms)} is out of "
                "range; allowed: 0 (leave the interpreter's alone) to 1000 (milliseconds)"
            )
        if not 0 <= self.burst_gather_ms <= 1000 or math.isnan(self.burst_gather_ms):
            raise ValueError(
                f"scheduler.burst_gather_ms: {describe(self.burst_gather_ms)} is out of range; "
                "allowed: 0 to 1000 (milliseconds)"
            )


SECTIONS: dict[str, type] = {
    "pool": PoolConfig,
    "kv": KVConfig,
    "kernel": KernelConfig,
    "scheduler": SchedulerConfig,
}


@dataclass(frozen=True)
class OxygenConfig:
    pool: PoolConfig = field(default_factory=PoolConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # dotted key -> where its non-default value came from ("enable()", "OXYGEN_CONF", "file:...")
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # model profiles given in the YAML file's `optimizations:` block, merged over the built-ins
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        # balanced decode holds every row's length in each program's registers (at most 4096
        # rows, paged_decode's MAX_BALANCED_BATCH): an engine step of more rows would fail
        if self.kernel.decode_balance and self.scheduler.max_step_seqs > 4096:
            raise ValueError(
                f"kernel.decode_balance: true with scheduler.max_step_seqs "
                f"{self.scheduler.max_step_seqs}; balanced decode takes at most 4096 rows a step "
                "(lower scheduler.max_step_seqs, or leave kernel.decode_balance false)"
            )

    def as_dict(self) -> dict[str, Any]:
        """Flat {dotted key: value} of every field."""
        out = {}
        for sec in SECTIONS:
            for f in dataclasses.fields(getattr(self, sec)):
                out[f"{sec}.{f.name}"] = getattr(getattr(self, sec), f.name)
        return out

    def diff(self, other: OxygenConfig) -> dict[str, tuple[Any, Any]]:
        """{dotted key: (self value, other value)} for every field that differs."""
        a, b = self.as_dict(), other.as_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
