"""Several nodes: routing keys, drain, readiness and the admin routes."""
