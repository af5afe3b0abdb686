"""Schedule generators (being written)."""
