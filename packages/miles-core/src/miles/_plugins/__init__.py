"""The implementation behind ``miles.plugins`` (import from there, not from here)."""
