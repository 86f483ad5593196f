"""A request's window in a step: how far its tokens can be computed before an item whose encoder work cannot be
scheduled (docs/ARCHITECTURE.md §2.4). An item waits, and the window is cut at its first token, when the
step's encoder budget or the encoder-cache mirror has no room for its rows, when its id was evicted earlier in
the step, or (payloads travelling with the encoder work, lazy) when no rank can take its payload (placement.py).

``plan_window`` only judges: the transfer decider (transfer.py) commits the window it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from common.ids import ItemId
from scheduler_svc.core import placement
from scheduler_svc.core.cache_mirrors import GroupMirrors
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_plan import payload_nbytes


@dataclasses.dataclass
class Window:
    """A tentative step window of one request, cut where an item's encoder work cannot be scheduled."""

    start: int  # first token of the window: the request's computed tokens (token index)
    end: int  # one past the last token to compute (token index)
    encode: list[int]  # item indices whose encoder work is scheduled this step (first occurrence of an id)
    reuse: list[int]  # item indices newly reached whose encoder output is (or will this step be) held
    owners: dict[int, int] = dataclasses.field(default_factory=dict)  # sharded lazy: encode index -> owner rank
    examined: int = 0  # items looked at to decide (the step's items_examined) (items)


def plan_window(
    request: Request,
    start: int,
    end: int,
    mirrors: GroupMirrors,
    budget_left: int,
    load: Sequence[int],
    *,
    first_room: int = 0,
    lazy: bool,
    sharded: bool,
) -> Window:
    """Cuts ``[start, end)`` before the first item whose encoder work cannot be scheduled; changes nothing.

    ``budget_left``: encoder rows the step can still schedule; ``first_room``: rows the step's first item may take
    beyond that (the encoder cache's room when the step encodes nothing yet, else 0: an item larger than the per-step
    budget is encoded alone in a step of its own rather than never); ``load``: encoder rows given to each rank this step
    (sharded owners go to the least loaded); ``lazy``: the request's payloads travel with its encoder work. Every
    check is cumulative over the window: what it encodes must fit beside everything it keeps."""
    features = request.mm_features
    window = Window(start, end, [], [])
    enc_ids: set[ItemId] = set()
    keep_enc: list[ItemId] = []
    enc_tokens = 0
    room = placement.Tentative.empty(load)  # the window's payload sends and keeps, per rank
    encoder = mirrors.encoder
    i = request.item_cursor
    while i < len(features) and features[i].mm_position.offset < end:
        window.examined += 1
        if i < request.pin_end:
            i += 1
            continue  # started in an earlier step: its encoder output is pinned
        f = features[i]
        key = f.identifier
        if key in enc_ids or (key in encoder and encoder.can_fit(enc_tokens, [*keep_enc, key])):
            window.reuse.append(i)
            keep_enc.append(key)
            i += 1
            continue  # its output is held (and kept beside the window's) or this window encodes it: nothing to do
        tokens = f.mm_position.get_num_embeds()
        fits = (
            key not in encoder  # held but its neighbours' room depends on evicting it: wait
            and mirrors.usable(key)
            and (enc_tokens + tokens <= budget_left or (enc_tokens == 0 and tokens <= first_room))
            and encoder.can_fit(enc_tokens + tokens, keep_enc)
        )
        if fits and lazy and sharded:
            owner = placement.choose_owner(mirrors.payloads, room, key, payload_nbytes(f), tokens)
            fits = owner is not None
            if owner is not None:
                window.owners[i] = owner
        elif fits and lazy:
            fits = placement.fits_every_rank(mirrors.payloads, room, key, payload_nbytes(f))
        if not fits:
            window.end = max(f.mm_position.offset, start)  # compute up to the item; it waits for room
            break  # later items start after it: the window ends here
        window.encode.append(i)
        enc_ids.add(key)
        enc_tokens += tokens
        i += 1
    return window
