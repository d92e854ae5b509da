"""swarmloco peer daemon (placeholder; the map of the code is written below as modules land)."""
