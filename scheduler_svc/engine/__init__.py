"""The engine: the request path both doors share (admission, the frontend, stop strings, cancellation) and the step
loop that drives the scheduling core and the group (docs/ARCHITECTURE.md §7: the layers)."""
