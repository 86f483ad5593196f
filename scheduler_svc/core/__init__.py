"""The scheduling core: requests, the prefix cache, transfer decisions, accounting and the step plan, as plain Python
with no I/O and no protobuf (docs/ARCHITECTURE.md §7: the layers)."""
