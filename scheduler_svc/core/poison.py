"""Poison isolation: finding the one request whose steps crash the worker group, and failing only it.

A group failure during a step (a rank exited, a collective broke, a rank refused the step, a missed deadline) says
only that something in that step, or a rank on its own, failed; the scheduler requeues every request and recovers
(docs/RELIABILITY.md). Without more, a request that crashes the ranks would do so again after every recovery, and
take its batch-mates with it each time. The rules, applied to the requests *scheduled* in the failing step:

- a step fails with requests that are not suspects: they become suspects (requeued as by any recovery, and
  batched as usual: ranks also fail for reasons of their own, and one failure is no evidence);
- a step holding exactly one request fails and that request is a suspect: it reproduced a failure alone — it is
  *convicted*: failed with INTERNAL, and nothing else changes;
- any other step holding suspects fails: those suspects are *isolated* — from now on each runs alone in its steps
  (one isolated suspect at a time, in queue order, before anything else) until it passes its *reach*, the token
  count where the group last failed with it; the step's other requests become suspects;
- a step holding one suspect alone completes at or past its reach: the suspect is cleared (it was innocent, or its
  failure did not reproduce). Suspects otherwise stay suspects until they finish.

So a poison request batched with innocent ones is found after three group failures (two batched, one alone), and
a lone one after two; the innocent ones are each run alone once, past the point where the group failed, and keep
going with exact answers (a recovered request is recomputed as new, so it continues identically). A rank that
fails for its own reasons while a suspect runs alone convicts that suspect: the price of not crashing forever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from common.ids import RequestId


@dataclasses.dataclass
class Suspect:
    reach: int  # tokens the request had computed at the end of the last failed step it was in
    isolated: bool = False  # in two failed steps: runs alone until a step of it completes at or past `reach`
    failures: int = 1  # failed steps it was scheduled in


class PoisonIsolator:
    """The isolation decisions as plain state; the scheduler core feeds it every step's scheduled requests."""

    def __init__(self) -> None:
        self.suspects: dict[RequestId, Suspect] = {}

    def step_failed(self, step: Mapping[RequestId, int]) -> RequestId | None:
        """The group failed during a step scheduling ``step`` (request -> tokens computed at the step's end).
        Returns the convicted request, if the step identifies one (it is forgotten here)."""
        if len(step) == 1:
            ((rid, _reach),) = step.items()
            if rid in self.suspects:
                del self.suspects[rid]
                return rid
        for rid, reach in step.items():
            suspect = self.suspects.get(rid)
            if suspect is None:
                self.suspects[rid] = Suspect(reach)
            else:
                suspect.reach, suspect.isolated = reach, True
                suspect.failures += 1
        return None

    def step_completed(self, step: Mapping[RequestId, int]) -> None:
        """A step scheduling ``step`` (request -> tokens computed at its end) completed on every rank."""
        if len(step) != 1:
            return  # a suspect is cleared only by a step it ran alone
        ((rid, reach),) = step.items()
        suspect = self.suspects.get(rid)
        if suspect is not None and reach >= suspect.reach:
            del self.suspects[rid]

    def alone(self, order: Iterable[RequestId]) -> RequestId | None:
        """The isolated suspect the next step must run alone: the first of ``order`` (running, then waiting)."""
        if not any(s.isolated for s in self.suspects.values()):
            return None
        return next((rid for rid in order if rid in self.suspects and self.suspects[rid].isolated), None)

    def forget(self, request_id: RequestId) -> None:
        """The request ended (finished, cancelled, failed); nothing is kept of it."""
        self.suspects.pop(request_id, None)
