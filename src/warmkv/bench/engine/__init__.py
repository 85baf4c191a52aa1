"""Benchmarks of the engine in process: coding loop, throughput, deep turns, chunks, speculative."""
