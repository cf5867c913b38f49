"""Where the configuration comes from: keyword overrides > OXYGEN_CONF > OXYGEN_CONFIG_FILE >
the documented defaults (see the package docstring)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
import typing
from typing import Any

from ..triton_kernels.precision import PrecisionMode
from .fields import (
    _MAX_DIGITS,
    ENV_CONF,
    ENV_FILE,
    MAX_CONFIG_FILE_BYTES,
    SECTIONS,
    OxygenConfig,
    describe,
)

log = logging.getLogger("oxygen_torch")

# --- parsing -------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def _resolve_key(key: str) -> tuple[str, str]:
    """'pool.hot_zone_ratio' or a bare unique field name -> (section, field)."""
    key = key.strip()
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ValueError(
                f"unknown configuration section {section!r} in key {key!r}; "
                f"allowed sections: {', '.join(SECTIONS)}"
            )
        if name not in _field_types(section):
            raise ValueError(
                f"unknown configuration key {key!r}; allowed in {section}: "
                f"{', '.join(_field_types(section))}"
            )
        return section, name
    owners = [s for s in SECTIONS if key in _field_types(s)]
    if len(owners) == 1:
        return owners[0], key
    if not owners:
        allowed = ", ".join(f"{s}.{n}" for s in SECTIONS for n in _field_types(s))
        raise ValueError(f"unknown configuration key {key!r}; allowed: {allowed}")
    raise ValueError(
        f"configuration key {key!r} is ambiguous; write one of "
        f"{', '.join(f'{s}.{key}' for s in owners)}"
    )


def _convert(section: str, name: str, value: Any) -> Any:
    """Turns a value (str from the environment, or a YAML/python value) into the field's type."""
    hint = _field_types(section)[name]
    where = f"{section}.{name}"
    optional = type(None) in typing.get_args(hint)
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if optional and (
        value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))
    ):
        return None
    if base is PrecisionMode:
        return PrecisionMode.parse(value)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: {value!r} is not a boolean; allowed: true/false")
    if base is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            m = _SIZE.match(value)
            if m and len(m.group(1)) > _MAX_DIGITS:
                raise ValueError(
                    f"{where}: an integer of {len(m.group(1))} digits is out of range for "
                    "every field"
                )
            if m:
                unit = (m.group(2) or "")[:1].lower()
                return int(m.group(1)) * _SIZE_UNITS.get(unit, 1)
        raise ValueError(
            f"{where}: {describe(value)} is not an integer (sizes may use KiB/MiB/GiB)"
        )
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: float(10**400)
            raise ValueError(f"{where}: {describe(value)} is not a number") from None
    if base is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {describe(value)} is not a string")
        return value.strip().lower()
    raise TypeError(f"{where}: no converter for {hint}")  # a programming error, not user input


def parse_conf_string(text: str) -> dict[str, Any]:
    """'pool.hot_zone_ratio:0.5,block_tokens:32' -> {'pool.hot_zone_ratio': 0.5, ...}, typed."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        if ":" not in item:
            raise ValueError(
                f"{ENV_CONF}: entry {describe(item.strip())} is not of the form key:value"
            )
        key, value = item.split(":", 1)
        section, name = _resolve_key(key)
        dotted = f"{section}.{name}"
        if dotted in out:
            raise ValueError(f"{ENV_CONF}: key {dotted!r} is given twice")
        out[dotted] = _convert(section, name, value)
    return out


def _flatten_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """enable(pool={...}, block_tokens=32, kernel=KernelConfig(...)) -> {dotted key: value}."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ValueError(f"configuration key {describe(key)} is not a name")
        if key in SECTIONS and not (isinstance(value, dict) or dataclasses.is_dataclass(value)):
            raise ValueError(
                f"configuration section {key!r} must be a mapping of its fields, got "
                f"{describe(value)}"
            )
        if key in SECTIONS:
            items = (
                value.items()
                if isinstance(value, dict)
                else ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
            )
            for name, v in items:
                section, name = _resolve_key(f"{key}.{name}")
                out[f"{section}.{name}"] = _convert(section, name, v)
        else:
            section, name = _resolve_key(key.replace("__", "."))
            out[f"{section}.{name}"] = _convert(section, name, value)
    return out


def _yaml_loader():
    """yaml.SafeLoader, stricter in two ways: a key given twice in one mapping is an error (YAML
    would keep the last silently; OXYGEN_CONF refuses the same), and an integer too long for any
    field stays text (Python refuses to convert one past 4,300 digits, with a message naming no
    field): the field's converter then refuses it by name."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if first != key_node.start_mark.line:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"key {describe(key)} is given twice (first on line {first + 1})",
                        key_node.start_mark,
                    )
            return super().construct_mapping(node, deep)

    def long_int(loader, node):
        text = loader.construct_scalar(node)
        if sum(c.isdigit() for c in text) > _MAX_DIGITS:
            return text
        return yaml.SafeLoader.construct_yaml_int(loader, node)

    Loader.add_constructor("tag:yaml.org,2002:int", long_int)
    return Loader


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


def _read_bytes(path: str) -> bytes:
    """The bytes of the regular file at `path`, at most MAX_CONFIG_FILE_BYTES. Opened without
    blocking and checked before reading: open() of a FIFO waits for a writer (forever, without
    O_NONBLOCK), and /dev/zero never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{ENV_FILE}: cannot read {path!r}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "not a file")
            raise ValueError(
                f"{ENV_FILE}: {path!r} is {kind}, not a regular file; {ENV_FILE} must name a "
                "YAML file"
            )
        if st.st_size > MAX_CONFIG_FILE_BYTES:
            raise ValueError(
                f"{ENV_FILE}: {path!r} holds {st.st_size} bytes, more than the "
                f"{MAX_CONFIG_FILE_BYTES} (1 MiB) a configuration file may hold"
            )
        with open(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{ENV_FILE}: cannot read {path!r}: {exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_FILE_BYTES:  # it grew after fstat()
        raise ValueError(
            f"{ENV_FILE}: {path!r} grew past {MAX_CONFIG_FILE_BYTES} bytes (1 MiB, the most a "
            "configuration file may hold) while it was read"
        )
    return data


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """YAML file -> ({dotted key: value}, {model_type: profile dict})."""
    import yaml

    try:
        text = _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{ENV_FILE}: {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); the file "
            f"named by {ENV_FILE} must be YAML in UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_yaml_loader()) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ValueError(f"{ENV_FILE}: {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_FILE}: {path!r} must hold a mapping at the top level")
    profiles = data.pop("optimizations", None) or {}
    if not isinstance(profiles, dict):
        raise ValueError(f"{ENV_FILE}: 'optimizations' must map model types to profiles")
    try:
        values = _flatten_overrides(data)
    except ValueError as exc:
        raise ValueError(f"{ENV_FILE} {path!r}: {exc}") from None
    from .profiles import validate_profile  # (profiles import fields only)

    for model_type, prof in profiles.items():
        validate_profile(str(model_type), prof)
    return values, {str(k): dict(v) for k, v in profiles.items()}


def load_config(**overrides: Any) -> OxygenConfig:
    """The effective configuration: overrides > OXYGEN_CONF > OXYGEN_CONFIG_FILE > defaults."""
    layers: list[tuple[str, dict[str, Any]]] = []
    profiles: dict[str, dict[str, Any]] = {}
    path = os.environ.get(ENV_FILE)
    if path:
        file_values, profiles = _read_file(path)
        layers.append((f"file:{path}", file_values))
    env = os.environ.get(ENV_CONF)
    if env:
        layers.append((ENV_CONF, parse_conf_string(env)))
    if overrides:
        layers.append(("enable()", _flatten_overrides(overrides)))

    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            merged[key] = value
            sources[key] = source
    sections = {}
    for sec, cls in SECTIONS.items():
        kwargs = {k.split(".", 1)[1]: v for k, v in merged.items() if k.startswith(sec + ".")}
        sections[sec] = cls(**kwargs)
    cfg = OxygenConfig(**sections, sources=sources, profiles=profiles)
    _warn_not_wired(cfg)
    return cfg


# Fields whose feature comes in a later issue: validated and documented, read by nothing yet
# (a non-default value warns once). None now: kv.prefetch_distance, the last, is the engine's
# swap-in ahead of a swapped call's step (integrations/hf/batched.py fetch).
NOT_WIRED: dict[str, str] = {}
_warned_not_wired: set[str] = set()


def _warn_not_wired(cfg: OxygenConfig) -> None:
    """Once per field and process: a non-default value of a field that does nothing yet says so,
    in load_config() so that enable(), pool() and apply() all see it."""
    defaults = OxygenConfig().as_dict()
    for key, value in cfg.as_dict().items():
        if key in NOT_WIRED and value != defaults[key] and key not in _warned_not_wired:
            _warned_not_wired.add(key)
            log.warning(
                "oxygen_torch: %s = %s has no effect yet: it is used by %s",
                key,
                describe(value),
                NOT_WIRED[key],
            )
