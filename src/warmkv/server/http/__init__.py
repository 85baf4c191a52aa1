"""What every request meets first: the guard (keys, limits), the node gate and model leases."""
