"""What the files are, pure (no torch, no I/O): names, dtypes, box geometry, the slice table,
the index and header validators, hashes and fingerprints, the format version (docs/format.md)."""
