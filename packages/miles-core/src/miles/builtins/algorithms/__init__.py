"""The built-in objective: advantage estimators (GRPO, GSPO, REINFORCE++, PPO/GAE), losses (PPO clip,
GSPO, clipped value, SFT), corrections (TIS, clip-or-pop), KL estimators and the distillation fold.
"""
