"""What the oxygen backend did, and which path paged prefill attention took, for tests and users:
counts since the last `reset_stats()`."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..kv import fresh
from . import linear_cat


@dataclass
class Left:
    """An attention the backend found and left as is."""

    pattern: str  # sdpa, aten_sdpa, matmul_softmax, mha
    reason: str
    where: str  # the user's source line, when Dynamo recorded it


@dataclass
class GraphReport:
    """One graph's attention sites; the pass fills it, `record` adds it to the totals."""

    found: int = 0
    rewritten: Counter = field(default_factory=Counter)  # pattern -> count
    left: list[Left] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def leave(self, pattern: str, reason: str, where: str = "") -> None:
        self.left.append(Left(pattern, reason, where))


_lock = threading.Lock()
_totals: dict[str, Any] = {}


def reset_stats() -> None:
    fresh.reset()
    linear_cat.reset()
    with _lock:
        _totals.clear()
        _totals.update(
            graphs_compiled=0,
            attention_found=0,
            rewritten=0,
            rewritten_by_pattern=Counter(),
            left=[],
            notes=[],
            cuda_graphs=Counter(),
        )


def record(report: GraphReport) -> None:
    with _lock:
        _totals["graphs_compiled"] += 1
        _totals["attention_found"] += report.found
        _totals["rewritten"] += sum(report.rewritten.values())
        _totals["rewritten_by_pattern"].update(report.rewritten)
        _totals["left"].extend(report.left)
        for note in report.notes:
            if note not in _totals["notes"]:
                _totals["notes"].append(note)


def count_cuda_graph(event: str, n: int = 1) -> None:
    """event: captured, replayed, skipped (no capture: too many shapes or not CUDA)."""
    with _lock:
        _totals["cuda_graphs"][event] += n


def stats() -> dict[str, Any]:
    """graphs_compiled, attention_found, rewritten, rewritten_by_pattern, left (count),
    left_reasons [{pattern, reason, where}], notes, cuda_graphs {captured, replayed, skipped},
    prefill_attention {dense, paged, why {reason: n}}: prefill attention calls (one per layer and
    forward) on the paged cache by path, dense being SDPA on a fresh prefill's own K/V
    (kv.fresh_prefill); linear_cat {groups_of_N, ran_apart}: linear layers on one input joined
    into one GEMM (compile/linear_cat.py), and its calls whose weights were not adjacent."""
    with _lock:
        return {
            "graphs_compiled": _totals["graphs_compiled"],
            "attention_found": _totals["attention_found"],
            "rewritten": _totals["rewritten"],
            "rewritten_by_pattern": dict(_totals["rewritten_by_pattern"]),
            "left": len(_totals["left"]),
            "left_reasons": [vars(x).copy() for x in _totals["left"]],
            "notes": list(_totals["notes"]),
            "cuda_graphs": dict(_totals["cuda_graphs"]),
            "prefill_attention": fresh.stats(),
            "linear_cat": linear_cat.stats(),
        }


reset_stats()
