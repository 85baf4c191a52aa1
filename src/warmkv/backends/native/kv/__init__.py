"""The native engine's KV: the paged block pool, blobs, pins and moves."""
