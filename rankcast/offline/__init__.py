"""The offline `LLM`: the engine core driven in the user's own process, no server, no sockets."""
