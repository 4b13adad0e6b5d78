"""Grafana dashboards as code (grafana-foundation-sdk); the generated JSON is committed beside."""
