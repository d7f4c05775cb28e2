"""Prometheus metrics of an API server: engine-derived series (identical on every server) and
this server's own request series."""
