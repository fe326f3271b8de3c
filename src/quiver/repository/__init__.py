"""Where model files come from."""
