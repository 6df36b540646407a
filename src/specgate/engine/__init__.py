"""The reference engine: continuous batching with the load gate, and its SGLang-compatible HTTP server."""
