"""Every attribute of a third-party object that oxygen_torch replaces, through one undo stack.

``replace(owner, name, value, why=..., group=...)`` records what was there (or that nothing was)
and why it was replaced; ``undo(group)`` puts back, newest first, what that group replaced;
``applied()`` lists what is replaced now, so an upgrade of torch or transformers can be audited
in one place and a test can prove that ``disable()`` left nothing behind. ``register(mapping,
key, value)`` does the same for an entry of a registry dict.

A private attribute that oxygen needs but cannot find is a layout it does not know: ``require``
warns once, naming the library version and what was not found, and the caller runs stock.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("oxygen_torch")

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    group: str  # who replaced it ("allocator", "transformers", "compile", ...)
    owner_ref: Any  # the owner, or a weak reference to it (weak=True: a model instance)
    name: str  # attribute name, or the key of a registry entry
    original: Any  # _MISSING: there was none
    value: Any
    why: str
    item: bool  # a registry entry (owner[name]) rather than an attribute
    weak: bool = False
    own: bool = True  # the owner held the attribute itself (not through its class)

    @property
    def owner(self) -> Any:
        return self.owner_ref() if self.weak else self.owner_ref

    def describe(self) -> str:
        where = getattr(self.owner, "__qualname__", None) or type(self.owner).__qualname__
        return f"{where}{f'[{self.name!r}]' if self.item else '.' + self.name}: {self.why}"


_lock = threading.RLock()
_stack: list[Patch] = []
_warned: set[str] = set()


def replace(owner: Any, name: str, value: Any, *, why: str, group: str, weak: bool = False) -> Any:
    """Sets owner.name = value, recording the original; returns the original (or None).
    weak: hold the owner weakly (an instance, such as a model, that must stay collectable)."""
    with _lock:
        try:
            # config objects and modules answer through __getattr__: treat as their own
            own = name in vars(owner) or not hasattr(type(owner), name)
        except TypeError:  # no __dict__ (slots, extension objects)
            own = True
        original = getattr(owner, name, _MISSING)
        ref = weakref.ref(owner) if weak else owner
        _stack.append(Patch(group, ref, name, original, value, why, False, weak, own))
        setattr(owner, name, value)
        return None if original is _MISSING else original


def register(mapping: dict, key: Any, value: Any, *, why: str, group: str) -> None:
    """mapping[key] = value, recording the entry that was there (if any)."""
    with _lock:
        _stack.append(Patch(group, mapping, key, mapping.get(key, _MISSING), value, why, True))
        mapping[key] = value


def undo(group: str) -> None:
    """Puts back everything `group` replaced, newest first."""
    with _lock:
        keep = []
        for p in reversed(_stack):
            if p.group != group:
                keep.append(p)
                continue
            owner = p.owner
            if owner is None:  # a weakly held owner that is gone: nothing to put back
                continue
            if p.item:
                if p.original is _MISSING:
                    owner.pop(p.name, None)
                else:
                    owner[p.name] = p.original
            else:
                _put_back(owner, p)
        _stack[:] = reversed(keep)


def _put_back(owner: Any, p: Patch) -> None:
    """owner.name is the original again: set back where the owner held it, removed where it
    came through the class (or was not there at all)."""
    if p.own and p.original is not _MISSING:
        setattr(owner, p.name, p.original)
        return
    try:
        delattr(owner, p.name)
    except AttributeError:
        pass


def applied(group: str | None = None) -> list[Patch]:
    """What is replaced now (weakly held owners that are gone left out), oldest first."""
    with _lock:
        return [p for p in _stack if (group is None or p.group == group) and p.owner is not None]


def require(owner: Any, name: str, *, library: str, what: str) -> Any:
    """owner.name, or None with one warning that oxygen does not know this `library` layout."""
    value = getattr(owner, name, _MISSING)
    if value is not _MISSING:
        return value
    warn_once(
        f"oxygen_torch: {library} {_version(library)} has no {_qualname(owner)}.{name}; {what}"
    )
    return None


def warn_once(message: str) -> None:
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    log.warning(message)


def forget_warnings() -> None:
    """Tests: every warning may be given once more."""
    with _lock:
        _warned.clear()


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or type(owner).__qualname__


def _version(library: str) -> str:
    try:
        from importlib.metadata import version

        return version(library)
    except Exception:
        return "(version unknown)"
