"""Statistics and Prometheus metrics: counts recorded once, read by both views."""
