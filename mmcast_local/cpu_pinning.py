"""Which CPUs the processes of a local group run on (serve-local ``--pin-cpus``)."""

from __future__ import annotations

from collections.abc import Sequence


def cpu_plan(cpus: Sequence[int], tp: int) -> dict[str, list[int]] | None:
    """Which CPUs each process of a local group is pinned to, or None (not pinned): with at least ``tp + 1`` CPUs the
    scheduler (its event loop, the HTTP door, the frontend threads) gets the first and every rank an equal slice of
    the rest, disjoint, so a rank's compute thread never waits behind the scheduler's work on its core and step times
    stop depending on where the kernel puts threads (vLLM pins its CPU engine core alike). CPUs beyond the equal
    slices go to the scheduler. With fewer CPUs the processes share them unpinned.

    Off by default (serve-local ``--pin-cpus``): on a 2-core machine with the load's clients on it too, pinned
    groups served 30-38 cached-image requests/s against 35-42 unpinned (40 at once, 32 tokens), as the kernel can no
    longer move a rank off a core the clients are using. It serves a machine whose other CPUs are idle."""
    cpus = sorted(set(cpus))
    if tp < 1 or len(cpus) < tp + 1:
        return None
    share = (len(cpus) - 1) // tp
    ranks = {f"rank{r}": cpus[1 + r * share : 1 + (r + 1) * share] for r in range(tp)}
    return {"scheduler": [cpus[0], *cpus[1 + tp * share :]], **ranks}
