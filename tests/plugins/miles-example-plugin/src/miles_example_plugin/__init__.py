"""A third-party Miles plugin, kept in the repo as a test fixture.

It provides a reward (``length_penalty``), a loss (``reinforce``) and a hook module
that adds an ``example`` section to recipes. Each is imported only when used.
"""

# The length the reward aims for, in response tokens. ``hooks.miles_configure`` sets it
# from the recipe's ``example.target_length``; it lives here so that neither module has
# to import the other.
target_length: int = 8
