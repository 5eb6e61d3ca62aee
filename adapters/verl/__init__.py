"""verl adapter (placeholder)."""
