"""Network entrypoints of the engine."""
