"""Live sessions: a conversation whose KV the scheduler keeps between turns, bounded to its last turns.

The streaming-assistant pattern (a new segment of a stream each turn, the last k kept) in its cheapest form: a turn
sends and computes only its own tokens. The session holds the KV blocks of its tokens between turns (under a holder
id in ``KVCacheManager``, never in the prefix cache: the rows carry this session's positions, not a fresh prompt's).

Layout of a session's tokens (``tokens``: the ones whose KV the blocks hold, contiguous from row 0)::

    prefix | turn 1: messages, generation prompt, answer, end of turn | turn 2 ... | turn k ... answer

``turns`` holds where each kept turn starts. The last answer's final token was sampled but not computed: it is kept
in ``pending`` and computed by the next turn, ahead of the template's end-of-turn tokens (``close_ids``, without
their first token when the answer already ended with it) and the new messages.

A turn past ``keep_turns`` evicts the oldest turns ``[a, b)``: the next request's prompt is the tokens without them,
its ranks first copy the KV of ``[b, c)`` onto ``[a, c - (b - a))`` (``kv_moves``; the rows keep the rotary
positions they were computed at), then compute the new tokens from ``c - (b - a)``. Positions never restart: the
new tokens continue from ``next_position`` (the model's rule over the new tokens alone, offset), so the kept turns'
KV stays exact. A request is never recomputed: preemption and group loss fail a live turn and close its session.

Every call is from the scheduler core's thread (the event loop), like the core itself.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from common.ids import RequestId
from scheduler_svc.core.step_plan import LiveContext

HOLDER_PREFIX = "\x00live/"  # block holders' ids: a client's request id never contains NUL


@dataclasses.dataclass
class LiveSession:
    key: tuple[str, str]  # (tenant, session id)
    keep_turns: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # computed tokens, their KV in ``blocks``
    pending: list[int] = dataclasses.field(default_factory=list)  # the last answer's uncomputed tail
    turns: list[int] = dataclasses.field(default_factory=list)  # start of each kept turn in ``tokens``
    blocks: list[int] = dataclasses.field(default_factory=list)  # held under ``holder``
    holder: RequestId | None = None
    next_position: int = 0  # position of pending[0] (or of the next turn's first token)
    busy: RequestId | None = None  # the turn in flight (reserved, waiting or running)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    turns_done: int = 0

    @property
    def opened(self) -> bool:
        return self.turns_done > 0


@dataclasses.dataclass
class LiveTurn:
    """A live request's link to its session, and what its finish does to the session."""

    session: LiveSession
    computed: int  # retained tokens the request starts with (its KV is the session's)
    blocks: list[int]  # the session's blocks, adopted at admission
    context: LiveContext  # what the ranks get
    turn_start: int  # where this turn starts in the request's tokens
    kept_turns: list[int]  # the session's kept turns' starts, after this turn's eviction
    evicted: int  # turns this turn evicts
    extent: int  # position span of the new tokens: the decode after the prompt sits at offset + extent + i
    close: bool  # end the session after this turn
    admitted: bool = False
    state: dict | None = None  # set when the turn ended: what GenerateFinal.live reports


class LiveSessions:
    """The sessions of one scheduler core (one KV pool). Bounded: ``max_sessions`` at once, closed when idle for
    ``idle_seconds``, and positions below ``max_positions``."""

    def __init__(self, kv, *, max_sessions: int, idle_seconds: float, max_turns: int, max_positions: int) -> None:
        self.kv = kv
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.max_turns = max_turns
        self.max_positions = max_positions
        self.sessions: collections.OrderedDict[tuple[str, str], LiveSession] = collections.OrderedDict()
        self._holders = 0
        self._expired_at = time.monotonic()
        self.closed_total = 0

    # --- the door's side --------------------------------------------------------------------------------------
    def reserve(self, key: tuple[str, str], request_id: RequestId, keep_turns: int) -> LiveSession:
        """The session for the turn ``request_id`` (opened when new), marked busy. Raises ABORTED while another
        turn is in flight, RESOURCE_EXHAUSTED when ``max_sessions`` are open and none is idle."""
        self.expire()
        if not 0 <= keep_turns <= self.max_turns:
            raise InvalidArgument(
                f"live.keep_turns={keep_turns} must be in [1, {self.max_turns}] (--max-live-turns; 0: the default)",
                field="live.keep_turns",
            )
        if self.max_sessions == 0:
            raise FailedPrecondition("live sessions are off on this server (--max-live-sessions 0)", field="live")
        session = self.sessions.get(key)
        if session is not None:
            if session.busy is not None:
                raise Aborted(
                    f"live session {key[1]!r} has a turn in flight ({session.busy}); send its turns one at a time",
                )
            if keep_turns:
                session.keep_turns = keep_turns
        else:
            if len(self.sessions) >= self.max_sessions and not self.close_idle_one():
                raise ResourceExhausted(
                    f"{len(self.sessions)} live sessions are open, each with a turn in flight (--max-live-sessions="
                    f"{self.max_sessions}); retry later",
                    field="live.session_id",
                    retry_after=1.0,
                )
            session = LiveSession(key, keep_turns or min(self.max_turns, 4))
            self.sessions[key] = session
        session.busy = request_id
        self.sessions.move_to_end(key)
        return session

    def release(self, session: LiveSession, request_id: RequestId) -> None:
        """The turn never reached the core (refused on the way): the session is as before it."""
        if session.busy == request_id:
            session.busy = None
            if not session.opened and self.sessions.get(session.key) is session:
                del self.sessions[session.key]

    def build(
        self,
        session: LiveSession,
        request_id: RequestId,
        *,
        turn_ids: list[int],
        turn_start: int,
        extent: int,
        close_ids: list[int],
        max_tokens: int,
        close: bool,
    ) -> tuple[list[int], int, LiveTurn]:
        """The turn's whole prompt, the offset of its ``turn_ids`` in it, and its ``LiveTurn``. ``turn_ids``: the
        new messages' tokens (on the first turn with the template's prefix before them; ``turn_start`` is where the
        messages begin), ``extent``: their position span (the model's rule over them alone), ``close_ids``: the
        template's end of an assistant turn."""
        if self.sessions.get(session.key) is not session or session.busy != request_id:
            raise NotFound(
                f"live session {session.key[1]!r} was closed while its turn was prepared (the worker group "
                "restarted); open a new session",
                field="live.session_id",
            )
        if not session.opened:
            base, computed, moves, kept, evicted = [], 0, (), [], 0
            lead: list[int] = []
        else:
            closing = close_ids
            last = (session.pending or session.tokens)[-1]
            if closing and last == closing[0]:
                closing = closing[1:]  # the answer ended with the end-of-turn token itself
            c = len(session.tokens)
            evicted = max(0, len(session.turns) + 1 - session.keep_turns)
            lead = session.pending + closing
            if evicted == 0:
                base, computed, moves, kept = list(session.tokens), c, (), list(session.turns)
            elif evicted < len(session.turns):
                a, b = session.turns[0], session.turns[evicted]
                base = session.tokens[:a] + session.tokens[b:]
                computed, moves = c - (b - a), ((b, a, c - b),)
                kept = [t - (b - a) for t in session.turns[evicted:]]
            else:  # every earlier turn goes: the prefix stays, the last answer's tail with it
                a = session.turns[0]
                base, computed, moves, kept, lead = session.tokens[:a], a, (), [], []
        offset = session.next_position
        if session.opened and not lead:
            offset += len(session.pending)  # the dropped tail's positions are not reused
        span = len(lead) + extent
        if offset + span + max_tokens > self.max_positions:
            raise OutOfRange(
                f"live session {session.key[1]!r}: this turn would reach position {offset + span + max_tokens}, past "
                f"the model's {self.max_positions} (positions only grow in a live session); open a new session",
                field="live.session_id",
            )
        prompt = base + lead + turn_ids
        turn = LiveTurn(
            session=session,
            computed=computed,
            blocks=list(session.blocks),
            context=LiveContext(offset, moves),
            turn_start=len(base) + len(lead) + turn_start,
            kept_turns=kept,
            evicted=evicted,
            extent=span,
            close=close,
        )
        return prompt, len(base) + len(lead), turn

    # --- the core's side --------------------------------------------------------------------------------------
    def finish(self, request, ok: bool) -> None:
        """``request`` (a live turn) ended. ``ok``: it finished generating (stop or length) after admission: the
        session keeps its KV. Otherwise an admitted turn closes the session (its KV was changed in place); one that
        never ran leaves the session as it was."""
        turn: LiveTurn = request.live
        session = turn.session
        if self.sessions.get(session.key) is not session:
            turn.state = self._state(session, turn, closed=True)
            return
        session.busy = None
        session.last_used = time.monotonic()
        if not turn.admitted:
            if not session.opened:
                del self.sessions[session.key]
            turn.state = self._state(session, turn, closed=not session.opened)
            return
        if not ok:
            self.close(session.key)
            turn.state = self._state(session, turn, closed=True)
            return
        computed = request.num_computed_tokens
        bs = self.kv.block_size
        table = self.kv.blocks_of(request.request_id)[: -(-computed // bs)]
        self._holders += 1
        holder = RequestId(f"{HOLDER_PREFIX}{self._holders}")
        self.kv.allocate(holder, len(table) * bs, table)
        if session.holder is not None:
            self.kv.free(session.holder)
        session.holder, session.blocks = holder, table
        tokens = request.all_token_ids
        session.tokens, session.pending = list(tokens[:computed]), list(tokens[computed:])
        session.turns = turn.kept_turns + [turn.turn_start]
        session.next_position = turn.context.position_offset + turn.extent + computed - request.num_prompt_tokens
        session.turns_done += 1
        if turn.close:
            self.close(session.key)
        turn.state = self._state(session, turn, closed=turn.close)

    @staticmethod
    def _state(session: LiveSession, turn: LiveTurn, *, closed: bool) -> dict:
        return {
            "session_id": session.key[1],
            "turns": 0 if closed else len(session.turns),
            "tokens": 0 if closed else len(session.tokens),
            "evicted_turns": turn.evicted if turn.admitted else 0,
            "next_position": session.next_position,
            "closed": closed,
        }

    def close(self, key: tuple[str, str]) -> None:
        session = self.sessions.pop(key, None)
        if session is None:
            return
        if session.holder is not None:
            self.kv.free(session.holder)
        session.holder, session.blocks = None, []
        self.closed_total += 1

    def close_idle_one(self) -> bool:
        """Closes the least recently used session with no turn in flight (its blocks return to the pool)."""
        for key, session in self.sessions.items():
            if session.busy is None:
                self.close(key)
                return True
        return False

    def expire(self, now: float | None = None) -> None:
        """Closes the sessions idle for ``idle_seconds`` (checked at most once a second)."""
        now = time.monotonic() if now is None else now
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        for key in [k for k, s in self.sessions.items() if s.busy is None and now - s.last_used > self.idle_seconds]:
            self.close(key)

    def drop_all(self, *, free: bool = True) -> None:
        """The ranks' KV is gone (group lost) or the pool was replaced: every session ends. ``free``: release the
        holders' blocks in the current pool (False when the pool itself is new)."""
        for key in list(self.sessions):
            session = self.sessions[key]
            if not free:
                session.holder = None
            self.close(key)
