"""The input of a step the scheduler wrote before it knew the previous step's tokens (async scheduling).

A delta with ``input_is_last_sampled`` carries no token: its input is the token the group sampled for the request in
the step just before. Every rank knows which requests that step sampled (the windows that reached their known
tokens' end); rank 0 alone knows the tokens, and with several ranks it broadcasts them, in control order, on the
group's collective when the step commits (every rank reaches the commit of a step the group agreed on).
"""

from __future__ import annotations

import torch

from common.ids import RequestId
from worker_svc.step_errors import StepError, code


class LastSampled:
    """What the previous step sampled: the request ids (every rank) and their tokens (rank 0)."""

    def __init__(self) -> None:
        self.ids: set[RequestId] = set()
        self.tokens: dict[RequestId, int] = {}  # rank 0; a request whose sampling failed has none (its step is void)

    def clear(self) -> None:
        self.ids, self.tokens = set(), {}

    def record(self, windows, sampled) -> None:
        """After a step's execution: ``windows`` the (state, start, end) computed; ``sampled`` rank 0's (id, Sample)."""
        self.ids = {s.request_id for s, _start, end in windows if end == len(s.token_ids)}
        self.tokens = {rid: sample.token_id for rid, sample in sampled}

    def check(self, running) -> None:
        """A delta that takes the last sampled token brings no token of its own, and the previous step sampled it."""
        for state, delta in running:
            if not delta.input_is_last_sampled:
                continue
            where = f"running[{delta.request_id}]"
            if delta.new_token_ids:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"{where}: input_is_last_sampled with {len(delta.new_token_ids)} new_token_ids (must be none)",
                    delta.request_id,
                )
            if state.request_id not in self.ids:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"{where}: input_is_last_sampled, but the previous step sampled no token for it",
                    delta.request_id,
                )

    def resolve(self, running, rank: int, group) -> dict[RequestId, int]:
        """The token of every delta that takes the last sampled one (rank 0's, broadcast to the other ranks)."""
        wanted = [state.request_id for state, delta in running if delta.input_is_last_sampled]
        if not wanted:
            return {}
        # A request whose sampling failed on rank 0 gets a stand-in: the scheduler fails it and drops this step's token.
        values = torch.tensor([self.tokens.get(rid, 0) if rank == 0 else 0 for rid in wanted], dtype=torch.int64)
        if group is not None and getattr(group, "world_size", 1) > 1:
            group.broadcast(values, 0)
        return dict(zip(wanted, values.tolist(), strict=True))


def extra_tokens(delta) -> int:
    """Tokens a delta adds to the request besides ``new_token_ids`` (the last sampled one, or none)."""
    return 1 if delta.input_is_last_sampled else 0
