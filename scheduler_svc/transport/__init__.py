"""The group transport: the step plan as protobuf, one stream per rank, and the prefix-cache events published for
routers (docs/ARCHITECTURE.md §7: the layers)."""
