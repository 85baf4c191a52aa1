"""The disk tier: a SQLite index and blob files in checksummed containers, and its one writer thread."""
