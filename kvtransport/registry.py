"""Backend registry: entry points of the group ``kvtransport.backends`` (built-in and third-party alike)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

from .backend import Availability, BackendSpec
from .errors import BackendUnavailable, UnknownBackend

GROUP = "kvtransport.backends"

KNOWN_BACKENDS = {
    "nccl": "pip install ./backends/nccl   (torch.distributed: NCCL for CUDA memory, gloo for host memory)",
    "ucx": "pip install ./backends/ucx     (UCX one-sided puts; pulls ucxx-cu12 / libucx wheels)",
    "mscclpp": "build MSCCL++ from upstream source, then pip install ./backends/mscclpp (backends/mscclpp/README.md)",
}
"""Install hints for the project's own backends, shown when they are missing."""


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`available_backends`."""

    name: str
    installed: bool
    available: bool
    reason: str
    priority: int
    install_hint: str

    def __str__(self) -> str:
        state = "available" if self.available else ("unavailable" if self.installed else "not installed")
        tail = f": {self.reason}" if self.reason else ""
        return f"{self.name:<9} {state}{tail}"


@functools.cache
def _specs() -> dict[str, BackendSpec]:
    specs: dict[str, BackendSpec] = {}
    for ep in metadata.entry_points(group=GROUP):
        try:
            spec = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            specs[ep.name] = _BrokenSpec(ep.name, f"entry point {ep.value} failed to load: {exc}")
            continue
        specs[ep.name] = spec
    return specs


def specs() -> dict[str, BackendSpec]:
    """Registered backend specs by name (loaded once per process)."""
    return dict(_specs())


def get_spec(name: str) -> BackendSpec:
    """The spec for ``name``; raises UnknownBackend naming what is installed and how to get the rest."""
    all_specs = _specs()
    if name in all_specs:
        return all_specs[name]
    installed = ", ".join(sorted(all_specs)) or "none"
    hint = KNOWN_BACKENDS.get(name)
    msg = f"KV_TRANSPORT={name}: no such backend is installed (installed: {installed})."
    if hint:
        msg += f" To install it: {hint}"
    else:
        msg += " Known backends: " + "; ".join(f"{k}: {v}" for k, v in KNOWN_BACKENDS.items())
    raise UnknownBackend(msg)


@functools.cache
def probe(name: str) -> Availability:
    """Cached :meth:`BackendSpec.probe` of a registered backend."""
    try:
        return get_spec(name).probe()
    except Exception as exc:  # probe must never raise; be defensive about third-party code
        return Availability(False, f"probe failed: {exc}")


def available_backends() -> list[BackendInfo]:
    """Every registered backend (usable or not, with the reason) plus known ones that are not installed."""
    rows = []
    all_specs = _specs()
    for name, spec in sorted(all_specs.items()):
        av = probe(name)
        rows.append(BackendInfo(name, True, av.ok, av.reason, spec.priority, spec.install_hint))
    for name, hint in KNOWN_BACKENDS.items():
        if name not in all_specs:
            rows.append(BackendInfo(name, False, False, f"not installed; {hint}", -1, hint))
    return rows


def choose(name: str, memory_kind: str) -> BackendSpec:
    """Resolve ``auto`` or a name to a usable spec for ``memory_kind``; raises a typed error with the fix."""
    if name != "auto":
        spec = get_spec(name)
        av = probe(name)
        if not av.ok:
            raise BackendUnavailable(f"backend {name!r} cannot run here: {av.reason}")
        if memory_kind not in spec.memory_kinds:
            raise BackendUnavailable(
                f"backend {name!r} cannot move {memory_kind} memory (it supports {sorted(spec.memory_kinds)}); "
                "pick another with KV_TRANSPORT"
            )
        return spec
    candidates = [
        s for n, s in _specs().items() if s.auto_select and memory_kind in s.memory_kinds and probe(n).ok
    ]
    if not candidates:
        rows = "; ".join(str(r) for r in available_backends())
        raise BackendUnavailable(f"no usable backend for {memory_kind} memory. Backends: {rows}")
    return max(candidates, key=lambda s: (s.priority, s.name))


class _BrokenSpec(BackendSpec):
    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        self.auto_select = False

    def probe(self) -> Availability:
        return Availability(False, self.reason)

    def create(self, layout, settings):  # type: ignore[no-untyped-def]
        raise BackendUnavailable(self.reason)
