"""Live KV sessions, the lookup order that reuses them, and checkpoints on disk.

`pool.SessionPool` is owned by the engine's worker thread, like the model: nothing here is
shared between threads.
"""
