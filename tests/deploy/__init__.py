"""Deployment checks: the Helm chart, the Grafana dashboard, the Prometheus rules and the Dockerfile."""
