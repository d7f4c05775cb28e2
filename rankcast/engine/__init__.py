"""The engine core (scheduler, KV block accounting, the step loop) and its clients."""
