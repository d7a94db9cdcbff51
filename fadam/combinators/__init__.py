"""Transforms built from other transforms."""
