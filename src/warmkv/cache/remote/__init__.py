"""The remote tier: KV containers in Redis or Valkey, with link health and transfer rates."""
