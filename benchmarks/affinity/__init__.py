"""Conversation affinity: the SDK's ring hash against round robin, Envoy's consistent hashing."""
