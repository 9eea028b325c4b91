"""Connectors to other environment frameworks, each at the plug-in layer the framework owns.

- ``verifiers`` (``miles.rollouts``): a Verifiers environment replaces the rollout function; its
  OpenAI client talks to the session server, so the samples hold the server's tokens.
- ``openenv`` (``miles.agents``): an OpenEnv environment driven by an agent function through the
  session server; the environment's reward is the episode's reward.

Each imports its library only when used (``pip install 'miles-envs[verifiers]'`` / ``[openenv]``).
"""
