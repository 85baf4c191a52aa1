"""The memory tier: block hashes and the prefix cache with its integrity check."""
