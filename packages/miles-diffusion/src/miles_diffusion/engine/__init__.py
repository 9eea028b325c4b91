"""The diffusion engine: the package's sampler served as a rollout engine the core launches.

``python -m miles_diffusion.engine --model DIR`` loads a model directory and serves a small HTTP
API on 127.0.0.1 (``server``); ``DiffusionLauncher`` (the ``diffusion`` engine kind) starts and
supervises such processes like the core's own engines, and ``DiffusionClient`` talks to them.
"""
