"""The KV layout model: one worker's paged KV cache described as byte regions.

A :class:`KVLayout` holds, per layer, one or more *planes*. A plane is the set of contiguous pieces that
belong to each block: piece ``b`` of a plane starts at ``base + b * block_stride`` and is ``piece_bytes``
long. vLLM's layouts (one backing buffer, per-layer views ``[num_blocks, heads, block_size, 2*head]`` in any
stride permutation) have one plane per layer when the block dimension is physically outside the rest, and
several planes when it is not (e.g. K and V stored apart, or heads outermost).

The compatibility signature covers everything that must match between two peers for bytes to mean the
same thing on both sides (per-block logical shape, dtype, physical dimension order, plane sizes), and
nothing that may differ (addresses, number of blocks, device).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import LayoutError

MAX_PLANES_PER_LAYER = 64
"""A layer whose block piece splits into more planes than this is refused (it would be thousands of tiny
segments per block: re-lay the cache so the block dimension is outer)."""


@dataclass(frozen=True, slots=True)
class Plane:
    """Contiguous per-block pieces: block ``b`` occupies ``[base + b*block_stride, +piece_bytes)``."""

    base: int
    block_stride: int
    piece_bytes: int

    def address(self, block: int) -> int:
        return self.base + block * self.block_stride


@dataclass(frozen=True, slots=True)
class LayerRegion:
    """One layer of the cache: its name, its planes and the signature of its per-block contents."""

    name: str
    planes: tuple[Plane, ...]
    signature: str

    @property
    def block_bytes(self) -> int:
        """Bytes one block of this layer holds (all planes)."""
        return sum(p.piece_bytes for p in self.planes)


@dataclass(frozen=True)
class KVLayout:
    """A worker's KV cache as per-layer block regions (see module docstring).

    Build with :meth:`from_tensors` or :meth:`from_regions`. Immutable; holds references to the tensors it
    was built from (``keepalive``) so their memory outlives the layout.
    """

    layers: tuple[LayerRegion, ...]
    num_blocks: int
    device: str
    keepalive: tuple[object, ...] = field(default=(), compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, Any] | Sequence[Any], *, block_dim: int = 0
    ) -> KVLayout:
        """Describe per-layer KV tensors (torch tensors or numpy arrays, CPU or CUDA, any strides).

        ``tensors`` maps layer name -> tensor in layer order (a sequence is named ``layer.{i}``). Dimension
        ``block_dim`` indexes blocks. Raises :class:`LayoutError` for what cannot be described: negative or
        zero (broadcast) strides, overlapping blocks, mixed devices, differing block counts, too many planes.
        """
        items = list(tensors.items()) if isinstance(tensors, Mapping) else [
            (f"layer.{i}", t) for i, t in enumerate(tensors)
        ]
        if not items:
            raise LayoutError("KVLayout.from_tensors needs at least one layer tensor")
        layers: list[LayerRegion] = []
        devices: set[str] = set()
        num_blocks: int | None = None
        for name, tensor in items:
            info = _tensor_info(name, tensor)
            devices.add(info.device)
            ndim = len(info.shape)
            if not -ndim <= block_dim < ndim:
                raise LayoutError(f"layer {name!r}: block_dim={block_dim} out of range for shape {info.shape}")
            bdim = block_dim % ndim
            n = info.shape[bdim]
            if num_blocks is None:
                num_blocks = n
            elif n != num_blocks:
                raise LayoutError(
                    f"layer {name!r} has {n} blocks but earlier layers have {num_blocks}; "
                    "all layers of one cache must have the same number of blocks"
                )
            layers.append(_describe_tensor(name, info, bdim))
        if len(devices) != 1:
            raise LayoutError(f"all layers must live on one device; got {sorted(devices)}")
        assert num_blocks is not None
        return cls(tuple(layers), num_blocks, devices.pop(), tuple(t for _, t in items))

    @classmethod
    def from_regions(
        cls,
        num_blocks: int,
        layers: Sequence[Sequence[tuple[int, int, int]]],
        *,
        device: str = "cpu",
        names: Sequence[str] | None = None,
        keepalive: Sequence[object] = (),
    ) -> KVLayout:
        """Describe a cache from plain numbers: per layer a list of ``(base, block_stride, piece_bytes)``.

        The signature covers only the plane sizes (no dtype/shape is known). Raises :class:`LayoutError`.
        """
        if num_blocks < 1:
            raise LayoutError(f"num_blocks must be >= 1, got {num_blocks}")
        if not layers:
            raise LayoutError("a layout needs at least one layer")
        out: list[LayerRegion] = []
        for i, planes in enumerate(layers):
            name = names[i] if names is not None else f"layer.{i}"
            if not planes:
                raise LayoutError(f"layer {name!r} has no planes")
            ps = tuple(Plane(int(b), int(s), int(p)) for b, s, p in planes)
            for p in ps:
                if p.base <= 0 or p.block_stride < 0 or p.piece_bytes <= 0:
                    raise LayoutError(f"layer {name!r}: invalid plane {p} (base>0, stride>=0, piece>0 required)")
                if num_blocks > 1 and p.block_stride < p.piece_bytes and len(ps) == 1:
                    raise LayoutError(f"layer {name!r}: block_stride {p.block_stride} < piece {p.piece_bytes}: blocks overlap")
            _check_no_overlap(name, ps, num_blocks)
            sig = json.dumps({"planes": [p.piece_bytes for p in ps]}, sort_keys=True)
            out.append(LayerRegion(name, ps, sig))
        return cls(tuple(out), num_blocks, device, tuple(keepalive))

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def memory_kind(self) -> str:
        """``"cuda"`` or ``"cpu"``: what a backend must be able to read/write."""
        return "cuda" if self.is_cuda else "cpu"

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds across all layers."""
        return sum(layer.block_bytes for layer in self.layers)

    def signature(self) -> dict[str, Any]:
        """What must match between peers (see module docstring)."""
        return {"version": 1, "layers": [layer.signature for layer in self.layers]}

    def compat_hash(self) -> str:
        """A stable hex digest of :meth:`signature` (goes into the handshake)."""
        blob = json.dumps(self.signature(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def describe_mismatch(self, other_signature: Mapping[str, Any]) -> str:
        """Human-readable first difference between our signature and a peer's."""
        mine = self.signature()["layers"]
        theirs = list(other_signature.get("layers", []))
        if len(mine) != len(theirs):
            return f"layer count differs: ours {len(mine)}, peer's {len(theirs)}"
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b:
                return f"layer {i} ({self.layers[i].name}) differs: ours {a}, peer's {b}"
        return "signatures differ"

    def extents(self) -> list[tuple[int, int]]:
        """Merged ``(address, length)`` memory ranges covering every block of every plane (for registration)."""
        spans = []
        for layer in self.layers:
            for p in layer.planes:
                spans.append((p.base, p.base + (self.num_blocks - 1) * p.block_stride + p.piece_bytes))
        spans.sort()
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(s, e - s) for s, e in merged]

    def check_block_ids(self, ids: Sequence[int], what: str) -> None:
        """Raise :class:`InvalidBlockIds` if any id is outside ``[0, num_blocks)``."""
        from .errors import InvalidBlockIds

        for b in ids:
            if b >= self.num_blocks:
                raise InvalidBlockIds(f"{what} block id {b} is beyond the layout ({self.num_blocks} blocks)")

    # ------------------------------------------------------------------ wire form
    def to_wire(self) -> dict[str, Any]:
        """Addresses and signature as JSON-able data (what a one-sided peer needs to write into us)."""
        return {
            "num_blocks": self.num_blocks,
            "device": self.device,
            "layers": [
                {"name": layer.name, "sig": layer.signature, "planes": [[p.base, p.block_stride, p.piece_bytes] for p in layer.planes]}
                for layer in self.layers
            ],
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_wire`; validates types and raises :class:`LayoutError` on bad input."""
        try:
            num_blocks = data["num_blocks"]
            device = data["device"]
            raw_layers = data["layers"]
            if not isinstance(num_blocks, int) or not isinstance(device, str) or not isinstance(raw_layers, list):
                raise TypeError("bad field types")
            layers = []
            for raw in raw_layers:
                planes = tuple(Plane(*_three_ints(p)) for p in raw["planes"])
                if not planes or len(planes) > MAX_PLANES_PER_LAYER:
                    raise ValueError("plane count out of range")
                if not isinstance(raw["name"], str) or not isinstance(raw["sig"], str):
                    raise TypeError("bad layer fields")
                layers.append(LayerRegion(raw["name"], planes, raw["sig"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"malformed layout description from peer: {exc}") from None
        if num_blocks < 1 or not layers:
            raise LayoutError("malformed layout description from peer: empty")
        return cls(tuple(layers), num_blocks, device)


def _three_ints(p: Any) -> tuple[int, int, int]:
    if not isinstance(p, list) or len(p) != 3 or not all(isinstance(x, int) and x >= 0 for x in p):
        raise ValueError(f"plane must be three non-negative ints, got {p!r}")
    return p[0], p[1], p[2]


# ---------------------------------------------------------------------- tensor description
@dataclass(frozen=True, slots=True)
class _TensorInfo:
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    data_ptr: int
    device: str
    dtype: str


def _tensor_info(name: str, t: Any) -> _TensorInfo:
    """Duck-typed view of a torch tensor or numpy array (no torch/numpy import here)."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
        item = int(t.element_size())
        return _TensorInfo(
            tuple(int(s) for s in t.shape),
            tuple(int(s) * item for s in t.stride()),
            item,
            int(t.data_ptr()),
            str(t.device),
            str(t.dtype).removeprefix("torch."),
        )
    if hasattr(t, "__array_interface__"):  # numpy
        return _TensorInfo(
            tuple(int(s) for s in t.shape),
            tuple(int(s) for s in t.strides),
            int(t.itemsize),
            int(t.__array_interface__["data"][0]),
            "cpu",
            str(t.dtype),
        )
    raise LayoutError(f"layer {name!r}: expected a torch tensor or numpy array, got {type(t).__name__}")


def _describe_tensor(name: str, info: _TensorInfo, bdim: int) -> LayerRegion:
    shape, strides = info.shape, info.strides
    if any(s < 0 for s in strides):
        raise LayoutError(f"layer {name!r}: negative strides {strides} are not supported")
    num_blocks = shape[bdim]
    block_stride = strides[bdim]
    if num_blocks < 1:
        raise LayoutError(f"layer {name!r}: no blocks (shape {shape})")
    if info.data_ptr == 0:
        raise LayoutError(f"layer {name!r}: tensor has no storage (data_ptr is 0)")
    if num_blocks > 1 and block_stride == 0:
        raise LayoutError(f"layer {name!r}: block dimension has stride 0 (broadcast view); pass the real cache")
    inner = [(d, shape[d], strides[d]) for d in range(len(shape)) if d != bdim and shape[d] > 1]
    for d, _, st in inner:
        if st == 0:
            raise LayoutError(f"layer {name!r}: dimension {d} has stride 0 (broadcast view); pass the real cache")
    # innermost first: the dense suffix forms the contiguous piece, the rest enumerates planes
    inner.sort(key=lambda x: x[2])
    expected = info.itemsize
    k = 0
    while k < len(inner) and inner[k][2] == expected:
        expected *= inner[k][1]
        k += 1
    piece = expected
    outer = inner[k:]
    n_planes = 1
    for _, size, _ in outer:
        n_planes *= size
    if n_planes > MAX_PLANES_PER_LAYER:
        raise LayoutError(
            f"layer {name!r}: one block's data splits into {n_planes} separate pieces (shape {shape}, byte "
            f"strides {strides}); at most {MAX_PLANES_PER_LAYER} are supported - lay the cache out with the "
            "block dimension outside heads/tokens (e.g. vLLM's NHD or HND layouts)"
        )
    offsets = sorted(
        sum(i * st for i, (_, _, st) in zip(idx, outer, strict=True))
        for idx in itertools.product(*[range(size) for _, size, _ in outer])
    )
    planes = tuple(Plane(info.data_ptr + off, block_stride, piece) for off in offsets)
    _check_no_overlap(name, planes, num_blocks)
    # physical order of the logical per-block dims (outermost first), so NHD vs HND peers are told apart
    order = [d for d, _, _ in sorted(inner, key=lambda x: -x[2])]
    block_shape = [s for d, s in enumerate(shape) if d != bdim]
    rel_order = [d if d < bdim else d - 1 for d in order]
    sig = json.dumps(
        {"dtype": info.dtype, "itemsize": info.itemsize, "shape": block_shape, "order": rel_order,
         "planes": [p.piece_bytes for p in planes]},
        sort_keys=True,
    )
    return LayerRegion(name, planes, sig)


def _check_no_overlap(name: str, planes: Sequence[Plane], num_blocks: int) -> None:
    """Refuse layouts where two (plane, block) pieces share bytes."""
    for p, q in itertools.combinations_with_replacement(planes, 2):
        if p.block_stride != q.block_stride:
            # mixed strides (only via from_regions): check extents conservatively
            ps = (p.base, p.base + (num_blocks - 1) * p.block_stride + p.piece_bytes)
            qs = (q.base, q.base + (num_blocks - 1) * q.block_stride + q.piece_bytes)
            if ps[0] < qs[1] and qs[0] < ps[1]:
                raise LayoutError(f"layer {name!r}: planes {p} and {q} overlap")
            continue
        stride = p.block_stride
        d = q.base - p.base
        same = p is q
        if stride == 0:
            if not same and abs(d) < max(p.piece_bytes, q.piece_bytes):
                raise LayoutError(f"layer {name!r}: planes {p} and {q} overlap")
            continue
        k0 = d // stride
        for k in (k0 - 1, k0, k0 + 1):
            if abs(k) > num_blocks - 1 or (same and k == 0):
                continue
            gap = d - k * stride  # offset of q's piece (block j) relative to p's piece (block j+k)
            if -q.piece_bytes < gap < p.piece_bytes:
                raise LayoutError(
                    f"layer {name!r}: pieces overlap (plane at +{p.base:#x} vs +{q.base:#x}, block stride "
                    f"{stride}, piece {p.piece_bytes}); blocks must not share bytes"
                )


def pieces_crc32(layer: LayerRegion, runs: Sequence[tuple[int, int, int]], *, source: bool) -> int:
    """CRC-32 of the pieces a put reads (``source``) or writes, in a fixed order (plane, run, block), so
    sender and receiver compute the same value for a correct transfer. Host memory only (debug aid)."""
    import ctypes
    import zlib

    crc = 0
    for plane in layer.planes:
        for src, dst, count in runs:
            start = src if source else dst
            for b in range(start, start + count):
                crc = zlib.crc32(ctypes.string_at(plane.address(b), plane.piece_bytes), crc)
    return crc


def iter_segments(
    local: LayerRegion, remote: LayerRegion, runs: Sequence[tuple[int, int, int]]
) -> Iterator[tuple[int, int, int]]:
    """Yield ``(src_addr, dst_addr, nbytes)`` for every contiguous copy a list of runs needs.

    A run of ``count`` blocks becomes one segment per plane when both sides' blocks are back to back
    (``block_stride == piece_bytes``), else one per block and plane.
    """
    for lp, rp in zip(local.planes, remote.planes, strict=True):
        size = lp.piece_bytes
        dense = lp.block_stride == size and rp.block_stride == size
        for src, dst, count in runs:
            if dense:
                yield lp.base + src * size, rp.base + dst * size, count * size
            else:
                for i in range(count):
                    yield lp.address(src + i), rp.address(dst + i), size
