"""Connectors to other environment frameworks, each at the plug-in layer the framework owns.

- ``verifiers`` (``miles.rollouts``): a Verifiers environment replaces the rollout function; its
  OpenAI client talks to the session server, so the samples hold the server's tokens.
- ``openenv`` (``miles.agents``): an OpenEnv environment driven by an agent function through the
  session server; the environment's reward is the episode's reward.
- ``strands`` (``miles.agents``): a Strands Agents ``Agent`` whose model is the session server.
- ``nemo_gym`` (``miles.data_sources`` and ``miles.agents``): NeMo Gym datasets, and an agent that
  plays a NeMo Gym resources server over HTTP (its tools and ``/verify``) through the session server.
- ``harbor_tasks`` / ``harbor`` (``miles.data_sources`` / ``miles.agents``): Harbor task directories,
  each episode a ``harbor trial start`` whose agent (``harbor_bridge/``) calls the session server.

Each imports its library only when used (``pip install 'miles-envs[verifiers]'`` / ``[openenv]`` /
``[strands]``); ``nemo_gym`` and ``harbor`` import none: NeMo Gym and Harbor need Python 3.12+ and
run in environments of their own (servers over HTTP, a command line).
"""
