"""stip."""
