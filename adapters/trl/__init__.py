"""TRL adapter (placeholder)."""
