"""Recipes for ``miles run`` (the ``miles.recipes`` entry point): the diffusion recipes on the core loop.

The package's own driver (``python -m miles_diffusion.train``) reads ``miles_diffusion/recipes``.
"""
