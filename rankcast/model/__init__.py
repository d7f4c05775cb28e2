"""Model definitions, weight formats and loading."""
