"""The built-in rollout layers: a group rollout over a single-turn generate function."""
