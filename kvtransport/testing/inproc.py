"""An in-process reference backend (name ``inproc``): one-sided puts by memmove between managers that live
in the same process. For fast unit tests of the core only; never chosen by ``auto``."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence

from ..backend import (
    Answer,
    Availability,
    BackendSpec,
    Capabilities,
    Dialer,
    InboundLink,
    JSONDict,
    OutboundLink,
    PeerInfo,
    Transport,
)
from ..coalesce import BlockRun
from ..config import Settings
from ..errors import IncompatiblePeer, TransferError
from ..layout import KVLayout, iter_segments

CAPS = Capabilities(one_sided=True, memory_kinds=frozenset({"cpu"}), cross_host=False, notes="memmove, same process")


class _OutLink(OutboundLink):
    def __init__(self, local: KVLayout, remote: KVLayout) -> None:
        self.local, self.remote = local, remote
        self.closed = False
        self.fail_next: TransferError | None = None  # fault injection hook for tests

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        for src, dst, n in iter_segments(self.local.layers[layer], self.remote.layers[layer], runs):
            ctypes.memmove(dst, src, n)

    def flush(self, timeout: float) -> None:
        return None

    def describe(self) -> str:
        return "inproc memmove"

    def close(self) -> None:
        self.closed = True


class _InLink(InboundLink):
    def close(self) -> None:
        pass


class _Dialer(Dialer):
    def __init__(self, local: KVLayout, peer: PeerInfo) -> None:
        self.local, self.peer = local, peer
        self.request: JSONDict = {"pid": os.getpid()}

    def complete(self, reply: JSONDict, timeout: float) -> OutboundLink:
        return _OutLink(self.local, self.peer.layout)


class _Answer(Answer):
    def __init__(self) -> None:
        self.reply: JSONDict = {}

    def complete(self, timeout: float) -> InboundLink:
        return _InLink()


class InprocTransport(Transport):
    name = "inproc"
    capabilities = CAPS

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.links = 0
        self._lock = threading.Lock()

    def describe(self) -> JSONDict:
        return {"pid": os.getpid()}

    def dial(self, peer: PeerInfo) -> Dialer:
        if peer.transport.get("pid") != os.getpid():
            raise IncompatiblePeer("the inproc backend only links managers of one process; use nccl or ucx")
        return _Dialer(self.layout, peer)

    def answer(self, peer: PeerInfo, request: JSONDict) -> Answer:
        if request.get("pid") != os.getpid():
            raise IncompatiblePeer("the inproc backend only links managers of one process")
        return _Answer()

    def close(self) -> None:
        pass


class InprocSpec(BackendSpec):
    name = "inproc"
    priority = -100
    auto_select = False
    install_hint = "built in (kvtransport.testing)"
    memory_kinds = frozenset({"cpu"})
    cross_process = False
    test_only = True
    options = ()

    def probe(self) -> Availability:
        return Availability(True, "in-process reference backend (tests only)")

    def create(self, layout: KVLayout, settings: Settings) -> Transport:
        return InprocTransport(layout)


SPEC = InprocSpec()
