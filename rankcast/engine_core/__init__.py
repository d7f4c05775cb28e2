"""What runs in the engine-core process (or, for the offline `LLM`, in the caller's process
under `InprocClient`): the scheduler, KV block accounting, the adapter registry, the step loop.

Nothing here imports `rankcast.engine_client`; the two sides meet only through
`rankcast.protocol` (tests/test_import_layers.py holds this).
"""
