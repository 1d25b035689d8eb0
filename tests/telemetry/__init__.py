"""Telemetry tests against real processes: local trainer runs and a real Prometheus."""
