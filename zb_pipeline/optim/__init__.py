"""Optimizer-side pipeline machinery that the trainer plugs its optimizer into (post-validation)."""
