"""tangent."""
