"""Doorbells: completion words the sender's GPU writes into host memory the receiver reads, on one host.

The side channel's SIGNAL path costs a host wait for the copy, a socket hop and two thread hand-offs
(~150-450 µs on the 2xH200 host). When a link's puts are device launches into peer-mapped memory (CUDA IPC),
the sender also announces each signal in a shared-memory ring and has its stream write the signal's ticket
into a shared *completion word* right after the copies: the receiver's waiter sees completion by reading
that word. The SIGNAL frame still follows (it carries the ticket): whichever arrives first applies the
signal, the other is skipped, so a receiver that cannot map the ring (another host) loses nothing.

File layout (``/dev/shm``, created by the sender, unlinked by the receiver once mapped, or at close):

* offset 0: magic (8 bytes); offset 64: the completion word, a little-endian u64 (the last ticket whose
  puts landed), alone on its cache line.
* offset 4096: ``ENTRIES`` entries of ``ENTRY`` bytes; ticket t lives at ``(t - 1) % ENTRIES``:
  ``[u64 ticket][i32 layer (-1: whole sequence)][u16 length][encoded sequence id][... u64 ticket at ENTRY-8]``.

Writers store an entry's tail ticket before its head ticket; a reader takes an entry only when both equal
the ticket it expects, so a torn or overwritten entry is never applied (the frame path applies it).
Tickets start at 1 and increase by one per announced signal, per link.

Core module: standard library only. Who calls: the CommManager (sender: :class:`BellWriter`; receiver:
:class:`BellReader`). Nothing blocks.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct

from .errors import ProtocolError
from .semaphores import SeqId
from .wire import decode_seq, encode_seq

MAGIC = b"KVTBELL1"
WORD_OFFSET = 64
ENTRIES_OFFSET = 4096
ENTRY = 256
ENTRIES = 1024
SIZE = ENTRIES_OFFSET + ENTRIES * ENTRY
SHM_DIR = "/dev/shm"
_TICKET = struct.Struct("<Q")


def _slot(ticket: int) -> int:
    return ENTRIES_OFFSET + ((ticket - 1) % ENTRIES) * ENTRY


class BellWriter:
    """Sender side of one link's doorbell: owns the shared file and announces signals in its ring."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.path = os.path.join(directory, f"kvtransport-bell-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._map[0:8] = MAGIC
        self.ticket = 0  # the last ticket announced

    @property
    def address(self) -> int:
        """Host address of the mapping (page-aligned), for registering it with the device."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    @property
    def word_offset(self) -> int:
        return WORD_OFFSET

    def announce(self, seq: SeqId, layer: int | None) -> int:
        """Write the next ticket's entry; returns the ticket, or 0 when ``seq`` does not fit an entry (that
        signal then goes by the side channel alone). Not thread-safe: the caller serialises."""
        enc = encode_seq(seq)[2:]
        if 14 + len(enc) > ENTRY - _TICKET.size:
            return 0
        ticket = self.ticket + 1
        off = _slot(ticket)
        m = self._map
        _TICKET.pack_into(m, off, 0)  # invalidate the head first: a reader never takes a half-written entry
        struct.pack_into("<iH", m, off + 8, -1 if layer is None else layer, len(enc))
        m[off + 14 : off + 14 + len(enc)] = enc
        _TICKET.pack_into(m, off + ENTRY - 8, ticket)
        _TICKET.pack_into(m, off, ticket)
        self.ticket = ticket
        return ticket

    def completed(self) -> int:
        """The completion word (for tests and diagnostics)."""
        return int(_TICKET.unpack_from(self._map, WORD_OFFSET)[0])

    def close(self) -> None:
        """Unlink the file if the receiver has not (idempotent). The mapping stays valid until the object is
        collected, so a device write still in flight lands in mapped memory."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class BellReader:
    """Receiver side: maps the sender's file (and unlinks it), reads the completion word and the ring."""

    def __init__(self, path: str) -> None:
        if not (os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith("kvtransport-bell-")):
            raise ProtocolError(f"doorbell path {path!r} is not a kvtransport doorbell in {SHM_DIR}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != SIZE:
                raise ProtocolError(f"doorbell file {path} has the wrong size")
            self._map = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        if self._map[0:8] != MAGIC:
            raise ProtocolError(f"doorbell file {path} lacks the magic bytes")
        self.applied = 0  # every ticket up to this one was applied (by this ring or by a SIGNAL frame)
        self._ahead: set[int] = set()  # tickets above it that a SIGNAL frame applied

    def completed(self) -> int:
        return int(_TICKET.unpack_from(self._map, WORD_OFFSET)[0])

    def entry(self, ticket: int) -> tuple[SeqId, int | None] | None:
        """(sequence id, layer) announced for ``ticket``, or None if that entry is not (or no longer) there."""
        m = self._map
        off = _slot(ticket)
        if _TICKET.unpack_from(m, off)[0] != ticket:
            return None
        layer, n = struct.unpack_from("<iH", m, off + 8)
        if n > ENTRY - 22:
            return None
        raw = bytes(m[off + 14 : off + 14 + n])
        if _TICKET.unpack_from(m, off + ENTRY - 8)[0] != ticket or _TICKET.unpack_from(m, off)[0] != ticket:
            return None
        try:
            seq, _ = decode_seq(struct.pack("!H", n) + raw, 0)
        except ProtocolError:
            return None
        return seq, (None if layer < 0 else layer)

    def landed(self) -> list[tuple[SeqId, int | None]]:
        """The signals whose puts landed since the last call, in ticket order, minus those a SIGNAL frame
        applied first; stops at an entry it cannot read (the frames fill in). Caller serialises."""
        done = self.completed()
        out = []
        t = self.applied + 1
        while t <= done:
            if t in self._ahead:
                self._ahead.discard(t)
            else:
                e = self.entry(t)
                if e is None:
                    break
                out.append(e)
            t += 1
        self.applied = t - 1
        return out

    def in_flight(self) -> bool:
        """Whether the next ticket is announced but not landed yet (its copies are running: worth spinning)."""
        t = self.applied + 1
        return bool(_TICKET.unpack_from(self._map, _slot(t))[0] == t and self.completed() < t)

    def frame_applies(self, ticket: int) -> bool:
        """A SIGNAL frame carrying ``ticket`` arrived: True if it still needs applying (the ring has not).
        Frames may come in any ticket order (two threads signalling at once). Caller serialises."""
        if ticket <= self.applied or ticket in self._ahead:
            return False
        if ticket == self.applied + 1:
            self.applied = ticket
            while self.applied + 1 in self._ahead:
                self.applied += 1
                self._ahead.discard(self.applied)
        else:
            self._ahead.add(ticket)
        return True

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass
