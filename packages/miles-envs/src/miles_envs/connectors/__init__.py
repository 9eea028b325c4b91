"""Connectors to other environment frameworks, each at the plug-in layer the framework owns.

- ``verifiers`` (``miles.rollouts``): a Verifiers environment replaces the rollout function; its
  OpenAI client talks to the session server, so the samples hold the server's tokens.
- ``openenv`` (``miles.agents``): an OpenEnv environment driven by an agent function through the
  session server; the environment's reward is the episode's reward.
- ``strands`` (``miles.agents``): a Strands Agents ``Agent`` whose model is the session server.
- ``nemo_gym`` (``miles.data_sources`` and ``miles.agents``): NeMo Gym datasets, and an agent that
  plays a NeMo Gym resources server over HTTP (its tools and ``/verify``) through the session server.

Each imports its library only when used (``pip install 'miles-envs[verifiers]'`` / ``[openenv]`` /
``[strands]``); ``nemo_gym`` imports none: NeMo Gym's servers run in their own environment.
"""
