"""Tool sets: the calculator, and tools that run untrusted code in a sandbox."""
