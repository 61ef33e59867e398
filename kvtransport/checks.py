"""Validation of public call arguments: each check raises a typed error naming the argument, or returns the
value in its canonical form. Used by the CommManager before anything happens (no byte moved, no state
changed). Pure functions; no heavy imports."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import InvalidArgument, InvalidBlockIds, KVTransportError

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest bound any wait accepts: a week. Every blocking call takes a finite bound (there is no
"wait for ever"); far larger numbers would overflow the kernel's and poll's timeouts inside."""


def timeout_seconds(value: Any, what: str, *, zero_ok: bool = True,
                    error: type[KVTransportError] = InvalidArgument) -> float:
    """``value`` as a float number of seconds: a real number (not bool), finite, >= 0 (> 0 unless ``zero_ok``)
    and at most MAX_TIMEOUT_S; else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number of seconds, got {type(value).__name__} {value!r:.40}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise error(f"{what} must be {bound} seconds, got {value!r}")
    if seconds > MAX_TIMEOUT_S:
        raise error(f"{what}={value!r} seconds is too long: every wait takes a finite bound of at most "
                    f"{MAX_TIMEOUT_S:g} s (a week); pass a smaller one")
    return seconds


def layer_index(value: Any, num_layers: int) -> int:
    """``value`` as a layer index in [0, num_layers): an int (numpy integers too), not bool or float;
    else InvalidBlockIds (the layer is part of what a put addresses)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidBlockIds(f"layer must be an int, got {type(value).__name__} {value!r:.40}")
    layer = int(value)
    if not 0 <= layer < num_layers:
        raise InvalidBlockIds(f"layer {layer} out of range [0, {num_layers})")
    return layer


def layer_list(values: Any, num_layers: int) -> tuple[int, ...]:
    """A sequence of distinct layer indices (see :func:`layer_index`), or None for every layer."""
    if values is None:
        return tuple(range(num_layers))
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise InvalidBlockIds(f"layers must be a sequence of ints or None, got {type(values).__name__}")
    chosen = tuple(layer_index(v, num_layers) for v in values)
    if len(set(chosen)) != len(chosen):
        raise InvalidBlockIds(f"layers repeat: {list(chosen)}")
    return chosen


def block_id_list(values: Any, what: str) -> tuple[Any, ...]:
    """The block ids as a tuple (their values are checked by coalescing); InvalidBlockIds for a str, bytes,
    a mapping or anything that is not a finite sequence."""
    if isinstance(values, str | bytes | bytearray | dict) or not hasattr(values, "__iter__"):
        raise InvalidBlockIds(f"{what} must be a sequence of ints, got {type(values).__name__}")
    try:
        return tuple(values)
    except TypeError:
        raise InvalidBlockIds(f"{what} must be a sequence of ints, got {type(values).__name__}") from None


__all__ = ["MAX_TIMEOUT_S", "block_id_list", "layer_index", "layer_list", "timeout_seconds"]
