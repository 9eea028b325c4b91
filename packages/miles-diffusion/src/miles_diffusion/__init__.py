"""Miles diffusion-model RL: Flow-GRPO on flow-matching models (see README.md and docs/diffusion.md)."""
