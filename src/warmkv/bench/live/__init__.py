"""Benchmarks of a live server: serve, agent loops, reasoning loops, stream timing."""
