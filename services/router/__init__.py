"""The HTTP router: OpenAI-compatible API in front of one or more engine replicas' schedulers.

Owns HTTP connections, tokenizing and incremental detokenizing, stop strings, validation, API keys
and rate limits, and request records (shared through services.state). Never touches KV blocks or
the model: it speaks services.protocol to a scheduler over ZeroMQ.
"""
