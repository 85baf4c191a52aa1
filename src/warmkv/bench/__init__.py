"""Reproducible workloads and peer comparisons (`warmkv bench ...`)."""
