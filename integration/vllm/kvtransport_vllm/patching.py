"""Patch a vLLM module the moment it is imported (or at once when it already is): the one import hook behind
:mod:`.frontend` and :mod:`.primer`.

Who calls: their ``install`` (the plugin, once per vLLM process). :func:`on_import` never raises; a patch
function gets the fresh module and must not raise either (each logs what it could not wrap). Cheap: a dict
lookup per import until the modules named are imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

Patch = Callable[[ModuleType], None]

_patches: dict[str, list[Patch]] = {}
_lock = threading.Lock()


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the module's own loader, then runs the patches of that module on the fresh module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        with _lock:
            patches = list(_patches.get(module.__name__, ()))
        for patch in patches:
            patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules with patches only, asks the finders after it and wraps the loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _patches:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _PatchOnImport):
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def on_import(module_name: str, patch: Patch) -> None:
    """Run ``patch(module)`` on ``module_name``: now if it is imported already, else when it is. A patch is
    registered once per (module, function); the patch itself must be idempotent (a module re-imported, a second
    call)."""
    with _lock:
        patches = _patches.setdefault(module_name, [])
        if patch not in patches:
            patches.append(patch)
        module = sys.modules.get(module_name)
        if module is None and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
    if module is not None:
        patch(module)
