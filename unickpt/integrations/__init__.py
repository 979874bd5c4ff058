"""Drop-in checkpointers for other training frameworks, each in its own module (imported on demand:
``import unickpt`` imports none of them, nor the framework)."""
