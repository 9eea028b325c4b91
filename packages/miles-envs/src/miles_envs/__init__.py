"""Placeholder package: nothing is implemented yet (see README.md)."""
