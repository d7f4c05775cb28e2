"""Executors: how the engine core reaches its worker ranks."""
