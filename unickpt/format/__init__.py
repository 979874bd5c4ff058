"""The on-disk format, without torch: headers, index schema, hashes, names, commits.

``docs/format.md`` is the specification this package implements.
"""
