"""KV cache events for KV-aware routers: the radix tree's full blocks, hashed as vLLM hashes
them, published over ZeroMQ (docs/design/tenancy.md)."""
