"""A sampled token: what rank 0's sampler draws for one request in a step, and what the scheduler core receives
back (the wire's ``SampledToken``, worker.proto)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sample:
    """The token rank 0 sampled for one request in a step."""

    token_id: int  # the sampled token
    logprob: float | None = (
        None  # its log-probability under the unmodified distribution (natural log); None unless asked
    )
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, log-probability) alternatives, best first; only
    # tokens of non-zero probability (the sampler gives [] when the request asked for none)
