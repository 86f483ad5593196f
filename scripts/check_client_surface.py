"""Fails (exit 1) when the sync and async SDK clients drift apart (`make lint`).

Checked: `Client` and `AsyncClient` (and their streams) have the same public methods with the same parameters,
kinds and defaults (annotations may differ only in the sync/async types); each options TypedDict of
mmcast_client/_core/options.py has a default for every optional key and none for another.
"""

import inspect
import sys

from mmcast_client import AsyncClient, AsyncGenerationStream, Client, GenerationStream
from mmcast_client._core import options

# Names whose sync and async spellings differ by design: (sync, async).
PAIRED_METHODS = {"__enter__": "__aenter__", "__exit__": "__aexit__", "__iter__": "__aiter__", "__next__": "__anext__"}


def surface(cls: type) -> dict[str, list[tuple[str, object, object]]]:
    out = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in PAIRED_METHODS and name not in PAIRED_METHODS.values():
            continue
        if name in ("__init__",) or not callable(member):
            continue
        params = inspect.signature(member).parameters.values()
        out[PAIRED_METHODS.get(name, name)] = [(p.name, p.kind, p.default) for p in params]
    out["__init__"] = [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]
    return out


def main() -> int:
    problems = []
    for sync, aio in ((Client, AsyncClient), (GenerationStream, AsyncGenerationStream)):
        a, b = surface(sync), surface(aio)
        for name in sorted(a.keys() | b.keys()):
            if a.get(name) != b.get(name):
                problems.append(f"{sync.__name__}.{name} {a.get(name)} != {aio.__name__}.{name} {b.get(name)}")
    for typed, defaults in (
        (options.ClientOptions, options.CLIENT_DEFAULTS),
        (options.GenerateOptions, options.GENERATE_DEFAULTS),
    ):
        optional = set(typed.__annotations__) - {"max_tokens"}
        if optional != set(defaults):
            problems.append(f"{typed.__name__}: keys {sorted(optional ^ set(defaults))} lack a default or a key")
    for p in problems:
        print(f"client surface drift: {p}", file=sys.stderr)
    if not problems:
        print("sync and async clients share one surface")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
