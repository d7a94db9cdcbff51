"""Gradient transformations, one module per concern."""
