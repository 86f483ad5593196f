"""The doors: the gRPC client API and the OpenAI-compatible HTTP API, each translating its protocol into the engine's
requests (docs/ARCHITECTURE.md §7: the layers)."""
