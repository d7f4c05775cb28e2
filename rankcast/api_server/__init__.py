"""The OpenAI-compatible HTTP API served by each API server process."""
