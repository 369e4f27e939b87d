"""Telemetry: health endpoints, Prometheus metrics."""
