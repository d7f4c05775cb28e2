"""What a model is, before any process loads it: its architecture (`arch.py`), where its weights
are (`source.py`) and the GGUF-to-HF conversion (`gguf_convert.py`). No torch here: the launcher,
every API server, the engine core and every rank read these, so they are leaves."""
