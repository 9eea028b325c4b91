"""The built-in objective: GRPO advantages, the PPO clipped loss, truncated importance sampling."""
