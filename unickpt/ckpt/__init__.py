"""A checkpoint over a store, without torch: the reader (open, validate, locate, read, verify),
the writer, the Hugging Face layout, the manager's run layout, foreign formats detected."""
