"""The model's side of `serve`: the oxygen configuration (the server's defaults under the user's),
the checkpoint loaded from local files, the warm-up call. Run by the engine process, or by the
command's own with --one-process."""

from __future__ import annotations

import time
from pathlib import Path

# what the server sets unless the configuration does: the engine, and streams woken at most
# every 10 ms (a chunk holds the tokens of the steps since the last: hundreds of streams woken
# every step would take the interpreter lock from the engine's launches)
SERVE_DEFAULTS = {"scheduler.engine": True, "scheduler.stream_interval_ms": 10.0}


def serve_overrides(conf: str) -> dict:
    """enable()'s overrides: --conf, and SERVE_DEFAULTS where neither it nor OXYGEN_CONF nor
    the file sets the key."""
    import oxygen_torch
    from oxygen_torch.config import parse_conf_string

    overrides = parse_conf_string(conf) if conf else {}
    given = oxygen_torch.load_config(**overrides).sources
    for key, value in SERVE_DEFAULTS.items():
        if key not in given:
            overrides[key] = value
    return overrides


def configure_oxygen(conf: str):
    """enable() with --conf over OXYGEN_CONF / the file, and the server's defaults."""
    import oxygen_torch

    return oxygen_torch.enable(**serve_overrides(conf))


def load_tokenizer(path: str):
    """The tokenizer of a local checkpoint directory, nothing downloaded."""
    import transformers as T

    if not Path(path).is_dir():
        raise ValueError(f"{path}: not a directory (serve takes a local checkpoint directory)")
    return T.AutoTokenizer.from_pretrained(path, local_files_only=True)


def load(path: str, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) from a local directory, nothing downloaded; model on `device`."""
    import torch
    import transformers as T

    tokenizer = load_tokenizer(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = T.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    return model.to(device).eval(), tokenizer


def warm_up(model, pad: int, max_length: int | None = None) -> float:
    """The first-use costs paid before the first client: with the engine on,
    oxygen_torch.warm_up() (every rows bucket's decode graph captured, tables for sequences up
    to `max_length` tokens, at most its default 8,192; the KV pool made: its size bounds
    requests); else short greedy calls of one and of two rows. Returns seconds."""
    import torch

    import oxygen_torch
    from oxygen_torch.integrations.hf.warm import DEFAULT_LENGTH

    t0 = time.perf_counter()
    cfg = oxygen_torch.active_config()
    if cfg is not None and cfg.scheduler.engine:
        length = None
        if max_length:  # at most the default's bound and the model's positions
            top = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 0)
            bounds = [max_length, DEFAULT_LENGTH] + (
                [top] if isinstance(top, int) and top >= 2 else []
            )
            length = max(2, min(bounds))
        oxygen_torch.warm_up(model, max_length=length)
        return time.perf_counter() - t0
    for rows in (1, 2):
        ids = torch.full((rows, 4), pad, device=model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                           do_sample=False)  # fmt: skip
    return time.perf_counter() - t0
