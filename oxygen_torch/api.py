"""enable() / disable(): the one line users add, and what it attaches.

enable() validates the configuration, then attaches, in order, each part of oxygen_torch (the pool
as PyTorch's allocator, the HF integration, ...). disable() detaches them in reverse order.
"""

from __future__ import annotations

import threading
from typing import Any

from .config import OxygenConfig, load_config

_lock = threading.Lock()
_active: OxygenConfig | None = None


def _attachments():
    """(name, attach(cfg), detach()) for each part enable() switches on, in order."""
    return []


def enable(**overrides: Any) -> OxygenConfig:
    """Switch oxygen_torch on (call before the first CUDA allocation). Returns the config in force.

    Keyword overrides take precedence over OXYGEN_CONF and OXYGEN_CONFIG_FILE. Calling it again
    with the same effective configuration does nothing; with a different one it raises ValueError
    naming what differs (call disable() first).
    """
    global _active
    cfg = load_config(**overrides)
    with _lock:
        if _active is not None:
            diff = _active.diff(cfg)
            if not diff:
                return _active
            what = "; ".join(f"{k}: {a!r} now, {b!r} asked" for k, (a, b) in diff.items())
            raise ValueError(
                f"oxygen_torch is already enabled with a different configuration ({what}); "
                "call oxygen_torch.disable() first"
            )
        done = []
        try:
            for name, attach, detach in _attachments():
                attach(cfg)
                done.append((name, detach))
        except BaseException:
            for _, detach in reversed(done):
                detach()
            raise
        _active = cfg
        return cfg


def disable() -> None:
    """Undo what enable() did. Safe to call when not enabled."""
    global _active
    with _lock:
        if _active is None:
            return
        for _, _, detach in reversed(_attachments()):
            detach()
        _active = None


def is_enabled() -> bool:
    return _active is not None


def active_config() -> OxygenConfig | None:
    """The configuration enable() put in force, or None."""
    return _active
