"""The model table: load, evict, sleep and keep-alive, and the load/unload routes."""
