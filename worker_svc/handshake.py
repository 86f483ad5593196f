"""Handshake checks and the epoch rule of a rank: which scheduler stream it serves.

- A handshake must match the rank exactly: protocol version, model fingerprint, rank, world size, block size and,
  when the rank is configured with one, the scheduler id.
- While a stream is active, only a strictly newer epoch is accepted; it supersedes the active stream (whose
  state is dropped). An equal or older epoch is refused, naming both.
- With no stream active, an epoch below the newest one accepted so far is a stale scheduler and is refused; the
  newest epoch itself may reconnect (a scheduler recovering its broken stream), and starts from empty state.
"""

from __future__ import annotations

import dataclasses

from common.item_proto import PROTOCOL_VERSION
from mmcast.v1 import worker_pb2


class HandshakeRejected(Exception):
    """The handshake does not fit this rank; the message names the field and both values."""


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """What a handshake must match."""

    model_fingerprint: str
    rank: int
    world_size: int
    block_size: int
    scheduler_id: str = ""  # empty: any scheduler


def check_handshake(hs: worker_pb2.Handshake, me: RankIdentity) -> None:
    def mismatch(field: str, theirs: object, mine: object) -> HandshakeRejected:
        return HandshakeRejected(f"handshake.{field}={theirs!r} does not match this rank's {field}={mine!r}")

    if hs.protocol_version != PROTOCOL_VERSION:
        raise mismatch("protocol_version", hs.protocol_version, PROTOCOL_VERSION)
    if hs.model_fingerprint != me.model_fingerprint:
        raise mismatch("model_fingerprint", hs.model_fingerprint, me.model_fingerprint)
    if hs.rank != me.rank:
        raise mismatch("rank", hs.rank, me.rank)
    if hs.world_size != me.world_size:
        raise mismatch("world_size", hs.world_size, me.world_size)
    if hs.block_size != me.block_size:
        raise mismatch("block_size", hs.block_size, me.block_size)
    if me.scheduler_id and hs.scheduler_id != me.scheduler_id:
        raise mismatch("scheduler_id", hs.scheduler_id, me.scheduler_id)


class EpochGate:
    """Tracks the active stream's epoch and the newest epoch accepted."""

    def __init__(self) -> None:
        self.active_epoch: int | None = None
        self.newest_epoch: int | None = None

    def admit(self, epoch: int) -> bool:
        """Accepts ``epoch`` or raises; returns True when it supersedes an active stream."""
        if self.active_epoch is not None:
            if epoch <= self.active_epoch:
                raise HandshakeRejected(
                    f"handshake.scheduler_epoch={epoch} is not newer than the active stream's epoch "
                    f"{self.active_epoch}; only a newer epoch supersedes it"
                )
            superseded = True
        else:
            if self.newest_epoch is not None and epoch < self.newest_epoch:
                raise HandshakeRejected(
                    f"handshake.scheduler_epoch={epoch} is older than epoch {self.newest_epoch} already accepted "
                    "(a stale scheduler)"
                )
            superseded = False
        self.active_epoch = epoch
        self.newest_epoch = epoch if self.newest_epoch is None else max(self.newest_epoch, epoch)
        return superseded

    def release(self, epoch: int) -> None:
        """The stream of ``epoch`` ended (only the active one clears the slot)."""
        if self.active_epoch == epoch:
            self.active_epoch = None
