"""Streams of generations under a network fault, and what is checked of them afterwards.

Each stream is one SDK client (even ones upload images by hash, odd ones send the bytes inline). Every delta is
recorded with its arrival time, so the tokens as the client saw them (not only the final result) are compared with
the oracle: a token repeated or skipped across a recovery shows there. An outcome is either a complete result or an
exception whose status and message are reported; nothing may still be running at the join's deadline.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

from mmcast_client import Client, MmcastError
from tests.support.oracle import mismatch


class Streams:
    """Concurrent streaming generations of ``prompts`` (lists of chat messages), started with ``start()``."""

    def __init__(self, target: str, prompts: list[list[dict]], oracle, max_tokens: int, **client_kw) -> None:
        self.target = target
        self.prompts = prompts
        self.oracle = oracle
        self.max_tokens = max_tokens
        self.client_kw = {"timeout": 240, "first_token_timeout": None, **client_kw}
        self.deltas: list[list[tuple[float, list[int]]]] = [[] for _ in prompts]  # (arrival, token ids)
        self.outcomes: list = [None] * len(prompts)  # Result or exception
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(prompts))]

    def _run(self, i: int) -> None:
        try:
            with Client(self.target, upload_images=i % 2 == 0, **self.client_kw) as c:
                stream = c.generate(
                    self.prompts[i], max_tokens=self.max_tokens, ignore_eos=True, logprobs=0, stream=True
                )
                for delta in stream:
                    self.deltas[i].append((time.monotonic(), list(delta.token_ids)))
                self.outcomes[i] = stream.result
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.outcomes[i] = exc

    def start(self, stagger: float = 0.0) -> Streams:
        """Start every stream, ``stagger`` seconds apart (traffic spread over a fault rather than at its start)."""
        for k, t in enumerate(self.threads):
            if k and stagger:
                time.sleep(stagger)
            t.start()
        return self

    def seen(self) -> list[int]:
        return [sum(len(d[1]) for d in deltas) for deltas in self.deltas]

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(self.seen()) < n:
            assert time.monotonic() < deadline, f"streams stuck at {self.seen()} tokens"
            time.sleep(0.01)

    def join(self, timeout: float) -> None:
        """Every stream ended (completed or failed) within ``timeout``: no hang."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        hung = [i for i, t in enumerate(self.threads) if t.is_alive()]
        assert not hung, f"streams {hung} still running after {timeout} s (tokens {self.seen()})"

    # -- verdicts ---------------------------------------------------------------------------------------------------
    def wrong(self) -> dict[int, str]:
        """Per stream, why what the client received differs from the oracle (streamed tokens, then the result)."""
        out = {}
        for i, outcome in enumerate(self.outcomes):
            tokens, _ = self.oracle(self.prompts[i], self.max_tokens)
            streamed = [t for _, ids in self.deltas[i] for t in ids]
            if streamed != tokens[: len(streamed)]:
                first = next(k for k, (a, b) in enumerate(zip(streamed, tokens, strict=False)) if a != b)
                out[i] = f"streamed tokens differ from the oracle at index {first} (repeated or skipped)"
            elif isinstance(outcome, BaseException):
                continue
            elif streamed != tokens:
                out[i] = f"streamed {len(streamed)} tokens of {len(tokens)}"
            else:
                problem = mismatch(outcome, self.oracle(self.prompts[i], self.max_tokens))
                if problem:
                    out[i] = problem
        return out

    def failures(self) -> dict[int, str]:
        """Per failed stream, ``STATUS: message``."""
        out = {}
        for i, outcome in enumerate(self.outcomes):
            if isinstance(outcome, MmcastError):
                out[i] = f"{outcome.code.name if outcome.code else '?'}: {outcome}"
            elif isinstance(outcome, BaseException):
                out[i] = f"{type(outcome).__name__}: {outcome}"
        return out

    def statuses(self) -> dict[str, int]:
        counts = collections.Counter(
            (o.code.name if isinstance(o, MmcastError) and o.code else type(o).__name__)
            for o in self.outcomes
            if isinstance(o, BaseException)
        )
        return dict(counts)

    def resumed_after(self, t: float) -> float | None:
        """Seconds from ``t`` until every stream still open at ``t`` got its next token (None: none was open)."""
        waits = [min(later) - t for deltas in self.deltas if (later := [at for at, _ in deltas if at >= t])]
        return max(waits) if waits else None

    def figures(self, **extra) -> dict:
        failed = self.failures()
        return {
            "sent": len(self.prompts),
            "completed": len(self.prompts) - len(failed),
            "failed": self.statuses(),
            "wrong_tokens": len(self.wrong()),
            **extra,
        }


def report(name: str, **figures) -> dict:
    """Print one ``NETFAULT {...}`` line (docs/RELIABILITY.md quotes them); appended to $MMCAST_SOAK_REPORT too."""
    line = {"name": name, **{k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}}
    print(f"\nNETFAULT {json.dumps(line, sort_keys=True)}")
    path = os.environ.get("MMCAST_SOAK_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    return line
