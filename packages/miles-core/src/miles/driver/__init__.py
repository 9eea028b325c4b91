"""The pieces ``miles.loop`` drives: components resolved from the recipe, the rollout
stage, the training stage, and the processes (engines, trainer ranks) they talk to."""
