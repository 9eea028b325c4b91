"""Tool sets for multi-turn and agentic rollouts that run untrusted code in a sandbox."""
