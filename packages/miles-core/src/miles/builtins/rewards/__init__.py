"""Built-in rewards: exact_match, math, numeric_closeness, reasoning_gym, dapo, f1, multiple_choice,
and remote / remote_group (a reward model over HTTP). See docs/rewards.md."""
