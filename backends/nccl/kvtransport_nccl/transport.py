"""The ``nccl`` backend: torch.distributed point-to-point over a private 2-rank process group per link.

Two-sided: the sender gathers the coalesced runs of a layer into one staging buffer with one
``index_select`` per plane (no per-block Python loop) and sends it as one message; the receiver receives
it and scatters with one ``index_copy_`` per plane. A put that is a single run over a dense plane is sent
straight from (and received straight into) the KV cache, without staging. CUDA memory travels over NCCL,
host memory over gloo. Every link gets its own process group (sender rank 0, receiver rank 1) built on a
TCPStore hosted by the sender, so links never share a communicator across threads.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
import torch.distributed as dist

from kvtransport.backend import (
    Answer,
    Capabilities,
    Dialer,
    InboundLink,
    JSONDict,
    OutboundLink,
    PeerInfo,
    Transport,
)
from kvtransport.coalesce import BlockRun
from kvtransport.config import Settings, host_id, unknown_option
from kvtransport.errors import (
    BackendUnavailable,
    ConfigurationError,
    IncompatiblePeer,
    PeerDisconnected,
    TransferTimeout,
)
from kvtransport.layout import KVLayout, LayerRegion

STRATEGIES = ("pack", "per_run")
MAX_IN_FLIGHT = 8
"""Sends a link keeps in flight before put waits for the oldest (bounds staging memory)."""
log = logging.getLogger("kvtransport.nccl")
KNOBS = {"NCCL_SOCKET_IFNAME": "{ifname}", "GLOO_SOCKET_IFNAME": "{ifname}"}
_knobs_set: dict[str, str] = {}  # the knobs this process's open() calls wrote, and their values
_knobs_lock = threading.Lock()
MAX_HOST_CHARS = 253
"""The longest store host a link request may name (a DNS name's limit)."""
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_PREFIX = re.compile(r"[0-9a-f]{8,64}")
"""A link's store prefix: hex digits, as a dialer makes them (``secrets.token_hex(4)``), with room to grow."""


def _apply_interface_knobs(settings: Settings) -> None:
    """NET_IFNAME -> NCCL_/GLOO_SOCKET_IFNAME, at open() time (never at import). The variables are process-wide
    and read by torch.distributed: a value the user set is kept (and a different NET_IFNAME is logged); a value
    an earlier open() here set for another interface is a ConfigurationError, not a silent mix."""
    if settings.ifname is None:
        return
    with _knobs_lock:
        for key, template in KNOBS.items():
            want = template.format(ifname=settings.ifname)
            have = os.environ.get(key)
            if have is None:
                os.environ[key] = _knobs_set[key] = want
            elif have != want and _knobs_set.get(key) == have:
                raise ConfigurationError(
                    f"nccl backend: {key}={have} was set for an earlier CommManager in this process; torch.distributed "
                    f"reads it process-wide, so NET_IFNAME={settings.ifname} cannot apply here: use one interface "
                    "per process"
                )
            elif have != want:
                log.warning("nccl backend: %s=%s (set by the user) is kept; NET_IFNAME=%s does not override it",
                            key, have, settings.ifname)


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` wrapper so torch can view raw device memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor aliasing ``nbytes`` at ``ptr`` (host or CUDA)."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)


class _LayerViews:
    """Per-plane ``[num_blocks, piece_bytes]`` uint8 views of one layer."""

    def __init__(self, layer: LayerRegion, num_blocks: int, device: torch.device) -> None:
        self.planes = []
        for p in layer.planes:
            span = (num_blocks - 1) * p.block_stride + p.piece_bytes
            base = _bytes_at(p.base, span, device)
            self.planes.append(base.as_strided((num_blocks, p.piece_bytes), (p.block_stride, 1)))
        self.host_planes = [p.numpy() if device.type == "cpu" else None for p in self.planes]
        self.block_bytes = layer.block_bytes

    def direct(self, runs: Sequence[BlockRun], use_src: bool) -> torch.Tensor | None:
        """The run's bytes as one contiguous view when a put is one run over one dense plane."""
        if len(runs) != 1 or len(self.planes) != 1:
            return None
        r = runs[0]
        start = r.src if use_src else r.dst
        view = self.planes[0][start : start + r.count]
        return view if view.is_contiguous() else None


class TorchTransport(Transport):
    name = "nccl"

    def __init__(self, layout: KVLayout, settings: Settings) -> None:
        opts = dict(settings.backend_options)
        self.strategy = str(opts.pop("strategy", "pack"))
        if self.strategy not in STRATEGIES:
            raise ConfigurationError(f"nccl backend: strategy={self.strategy!r}; choose one of {STRATEGIES}")
        if opts:
            raise unknown_option(sorted(opts)[0], ("strategy",), "nccl backend")
        self.layout = layout
        self.settings = settings
        self.device = torch.device(layout.device)
        if self.device.type == "cuda":
            if not (dist.is_nccl_available() and torch.cuda.is_available()):
                raise BackendUnavailable("CUDA memory needs NCCL, which this torch build/machine lacks")
            torch.cuda.set_device(self.device)
            self.pg_kind = "nccl"
        else:
            if not dist.is_gloo_available():
                raise BackendUnavailable("host memory needs gloo, which this torch build lacks")
            self.pg_kind = "gloo"
        _apply_interface_knobs(settings)
        self.capabilities = Capabilities(
            one_sided=False, memory_kinds=frozenset({self.device.type}), cross_host=True,
            notes=f"torch.distributed {self.pg_kind}",
        )
        self.views = [_LayerViews(layer, layout.num_blocks, self.device) for layer in layout.layers]
        self.cache_ptrs = {int(p.untyped_storage().data_ptr()) for v in self.views for p in v.planes}

    def describe(self) -> JSONDict:
        info: JSONDict = {"pg": self.pg_kind, "torch": torch.__version__, "host": host_id()}
        if self.device.type == "cuda":
            info["gpu"] = str(torch.cuda.get_device_properties(self.device).uuid)
        return info

    def dial(self, peer: PeerInfo) -> Dialer:
        if peer.transport.get("pg") != self.pg_kind:
            raise IncompatiblePeer(f"peer moves {peer.transport.get('pg')} memory, we move {self.pg_kind}")
        mine = self.describe()
        if "gpu" in mine and peer.transport.get("gpu") == mine["gpu"] and peer.transport.get("host") == mine["host"]:
            raise IncompatiblePeer(
                "both peers use the same GPU, and NCCL cannot link two processes on one GPU; "
                "put them on different GPUs or use KV_TRANSPORT=ucx"
            )
        return _TorchDialer(self)

    def answer(self, peer: PeerInfo, request: JSONDict) -> Answer:
        return _TorchAnswer(self, *link_request(request))

    # ------------------------------------------------------------------ process groups
    def make_group(self, store: Any, rank: int, timeout: float) -> Any:
        td = datetime.timedelta(seconds=timeout)
        if self.pg_kind == "gloo":
            return _gloo_group(store, rank, td, self.settings.ifname, self.settings.address)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        return pg

    def close(self) -> None:
        self.views = []


def _gloo_group(store: Any, rank: int, timeout: datetime.timedelta, ifname: str | None, address: str) -> Any:
    """A 2-rank gloo group whose device is bound to ``ifname`` (else ``address``). Binding a device needs
    ``ProcessGroupGloo._Options``, which torch keeps private (2.4 .. 2.13 have it; there is no public way);
    looked up by name, so a torch without it still gets a group: the public constructor, whose device gloo
    picks from GLOO_SOCKET_IFNAME (set from NET_IFNAME at open()) or the hostname."""
    gloo = dist.ProcessGroupGloo
    options_type = getattr(gloo, "_Options", None)
    if options_type is None:
        log.warning("nccl backend: this torch has no ProcessGroupGloo._Options; gloo picks its own interface")
        return gloo(store, rank, 2, timeout)
    dev = gloo.create_device(interface=ifname) if ifname else gloo.create_device(hostname=address)
    opts = options_type()
    opts._devices = [dev]
    opts._timeout = timeout
    return gloo(store, rank, 2, opts)


class _TorchDialer(Dialer):
    def __init__(self, tr: TorchTransport) -> None:
        self.tr = tr
        self.store = _store_server(tr.settings.address, tr.settings.timeout)
        self.request: JSONDict = {"store_host": tr.settings.address, "store_port": int(self.store.port),
                                  "prefix": secrets.token_hex(4)}

    def complete(self, reply: JSONDict, timeout: float) -> OutboundLink:
        store = dist.PrefixStore(str(self.request["prefix"]), self.store)
        try:
            pg = self.tr.make_group(store, 0, timeout)
        except Exception as exc:
            raise PeerDisconnected(f"{self.tr.pg_kind} rendezvous with peer failed: {exc}") from None
        return _TorchOutLink(self.tr, pg, self.store)


def _store_server(address: str, timeout: float) -> Any:
    """A TCPStore server listening on ``address`` only (NET_IFNAME's address, or loopback).

    ``TCPStore(host, is_master=True)`` alone listens on every interface (``[::]``) whatever ``host`` says;
    handing it a socket we bound ourselves (``master_listen_fd``; the store takes the descriptor over)
    keeps the rendezvous on the interface the user chose."""
    try:
        sock = socket.create_server((address, 0))
    except OSError as exc:
        raise PeerDisconnected(f"cannot listen on {address} for the rendezvous: {exc}") from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(address, port, 2, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout), master_listen_fd=fd)
    except Exception as exc:
        raise PeerDisconnected(f"cannot start the rendezvous store on {address}:{port}: {exc}") from None


def _is_host(host: object) -> TypeGuard[str]:
    """An IP literal, or a hostname of at most MAX_HOST_CHARS characters in RFC 1123 labels."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split("."))


def link_request(request: JSONDict) -> tuple[str, int, str]:
    """The rendezvous (store host, store port, prefix) a sender's link request names, checked before any of it
    reaches torch.distributed: the host an IP literal or a hostname (``_is_host``), the port an int in
    1..65535, the prefix 8..64 lowercase hex digits. Raises IncompatiblePeer otherwise (the receiver refuses
    the handshake before its WELCOME; nothing connects anywhere)."""
    host, port, prefix = request.get("store_host"), request.get("store_port"), request.get("prefix")
    if not _is_host(host):
        raise IncompatiblePeer(f"malformed nccl link request: store_host {str(host)[:80]!r} is not an IP address or "
                               f"a hostname of at most {MAX_HOST_CHARS} characters")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise IncompatiblePeer(f"malformed nccl link request: store_port {str(port)[:80]!r} is not a port (1..65535)")
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise IncompatiblePeer(f"malformed nccl link request: prefix {str(prefix)[:80]!r} is not 8..64 hex digits")
    return host, port, prefix


class _TorchAnswer(Answer):
    def __init__(self, tr: TorchTransport, host: str, port: int, prefix: str) -> None:
        """``host``, ``port``, ``prefix``: the sender's rendezvous, checked by :func:`link_request`."""
        self.tr = tr
        self.host, self.port, self.prefix = host, port, prefix
        self.reply: JSONDict = {}

    def complete(self, timeout: float) -> InboundLink:
        host, port, prefix = self.host, self.port, self.prefix
        try:
            base = dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout))
            pg = self.tr.make_group(dist.PrefixStore(prefix, base), 1, timeout)
        except Exception as exc:
            raise PeerDisconnected(f"{self.tr.pg_kind} rendezvous with {host}:{port} failed: {exc}") from None
        return _TorchInLink(self.tr, pg, base)


def _ids(runs: Sequence[BlockRun], use_src: bool, device: torch.device) -> torch.Tensor:
    out: list[int] = []
    for r in runs:
        start = r.src if use_src else r.dst
        out.extend(range(start, start + r.count))
    return torch.tensor(out, dtype=torch.long).to(device, non_blocking=True)


def _wait(work: Any, timeout: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        text = str(exc)
        if "imeout" in text or "imed out" in text:
            raise TransferTimeout(f"{what} did not complete within {timeout:.3g}s: {text[:200]}") from None
        raise PeerDisconnected(f"{what} failed (peer gone?): {text[:300]}") from None


class _TorchOutLink(OutboundLink):
    def __init__(self, tr: TorchTransport, pg: Any, store: Any) -> None:
        self.tr, self.pg, self.store = tr, pg, store
        self.pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self.free: list[torch.Tensor] = []

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        views = self.tr.views[layer]
        self._reap()
        if self.tr.strategy == "per_run" and len(views.planes) == 1:
            for r in runs:
                chunk = views.planes[0][r.src : r.src + r.count]
                if not chunk.is_contiguous():
                    chunk = chunk.contiguous()
                self.pending.append((self._send(chunk), chunk))
            return
        buf = views.direct(runs, use_src=True)
        if buf is None:
            ids = _ids(runs, True, self.tr.device)
            n = len(ids)
            buf = self._staging(n * views.block_bytes)
            off = 0
            for p in views.planes:  # one gather per plane, into a reused staging buffer
                size = n * p.shape[1]
                torch.index_select(p, 0, ids, out=buf[off : off + size].view(n, p.shape[1]))
                off += size
        self.pending.append((self._send(buf), buf))

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A staging buffer not used by any send in flight (recycled: no allocation per put)."""
        for i, buf in enumerate(self.free):
            if buf.numel() >= nbytes:
                del self.free[i]
                return buf[:nbytes]
        return torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=self.tr.device)[:nbytes]

    def _send(self, buf: torch.Tensor) -> Any:
        try:
            return self.pg.send([buf.view(-1)], 1, 0)
        except Exception as exc:  # gloo/NCCL raise RuntimeError when the peer is gone
            raise PeerDisconnected(f"{self.tr.pg_kind} send failed (peer gone?): {str(exc)[:300]}") from None

    def _reap(self) -> None:
        while self.pending and self.pending[0][0].is_completed():
            self._recycle(self.pending.popleft()[1])
        # gloo reports a send complete only once it was waited on: bound what is in flight, or staging
        # buffers are never reused and memory grows with every request until flush
        while len(self.pending) >= MAX_IN_FLIGHT:
            _wait(self.pending[0][0], self.tr.settings.timeout, "send to peer")
            self._recycle(self.pending.popleft()[1])

    def _recycle(self, buf: torch.Tensor) -> None:
        if buf._base is not None and len(self.free) < 4 and buf.untyped_storage().data_ptr() not in self.tr.cache_ptrs:
            self.free.append(buf._base)

    def flush(self, timeout: float) -> None:
        while self.pending:
            work = self.pending[0][0]
            _wait(work, timeout, "send to peer")
            self._recycle(self.pending.popleft()[1])

    def describe(self) -> str:
        if self.tr.pg_kind == "nccl":
            return f"nccl ({self.tr.device})"
        return f"gloo tcp via {self.tr.settings.ifname or self.tr.settings.address} (slow path)"

    def close(self) -> None:
        self.pending.clear()
        _shutdown(self.pg)


class _TorchInLink(InboundLink):
    def __init__(self, tr: TorchTransport, pg: Any, store: Any) -> None:
        self.tr, self.pg, self.store = tr, pg, store
        self._set_device = False
        self.buf: torch.Tensor | None = None

    def _recv(self, buf: torch.Tensor, timeout: float) -> None:
        if self.tr.device.type == "cuda" and not self._set_device:
            torch.cuda.set_device(self.tr.device)
            self._set_device = True
        try:
            work = self.pg.recv([buf.view(-1)], 0, 0)
        except Exception as exc:
            raise PeerDisconnected(f"{self.tr.pg_kind} receive failed (peer gone?): {str(exc)[:300]}") from None
        _wait(work, timeout, "receive from peer")

    def receive(self, layer: int, runs: Sequence[BlockRun], timeout: float) -> None:
        views = self.tr.views[layer]
        if self.tr.strategy == "per_run" and len(views.planes) == 1:
            for r in runs:
                chunk = views.planes[0][r.dst : r.dst + r.count]
                tmp = chunk if chunk.is_contiguous() else torch.empty_like(chunk, memory_format=torch.contiguous_format)
                self._recv(tmp, timeout)
                if tmp is not chunk:
                    chunk.copy_(tmp)
            self._sync()
            return
        direct = views.direct(runs, use_src=False)
        if direct is not None:
            self._recv(direct, timeout)
            self._sync()
            return
        n = sum(r.count for r in runs)
        buf = self._staging(n * views.block_bytes)
        self._recv(buf, timeout)
        ids = _ids(runs, False, self.tr.device)
        off = 0
        for p, host in zip(views.planes, views.host_planes, strict=True):
            size = n * p.shape[1]
            part = buf[off : off + size].view(n, p.shape[1])
            if host is not None:  # numpy's row scatter is ~5x faster than index_copy_ on the CPU
                host[ids.numpy()] = part.numpy()
            else:
                p.index_copy_(0, ids, part)
            off += size
        self._sync()

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=self.tr.device)
        return self.buf[:nbytes]

    def discard(self, layer: int, runs: Sequence[BlockRun], timeout: float) -> None:
        views = self.tr.views[layer]
        if self.tr.strategy == "per_run" and len(views.planes) == 1:
            for r in runs:
                self._recv(torch.empty(r.count * views.block_bytes, dtype=torch.uint8, device=self.tr.device), timeout)
            return
        n = sum(r.count for r in runs)
        self._recv(self._staging(n * views.block_bytes), timeout)

    def _sync(self) -> None:
        if self.tr.device.type == "cuda":
            torch.cuda.current_stream(self.tr.device).synchronize()

    def close(self) -> None:
        _shutdown(self.pg)


def _shutdown(pg: Any) -> None:
    try:
        if hasattr(pg, "abort"):
            pg.abort()
    except Exception:
        pass
