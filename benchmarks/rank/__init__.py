"""One rank's engine: its step time and memory against a plain transformers run, paged attention, grammar masks."""
