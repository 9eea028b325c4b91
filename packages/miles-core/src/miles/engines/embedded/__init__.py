"""The embedded rollout engine: a Hugging Face transformers model behind SGLang's native HTTP API.

Run it with ``python -m miles.engines.embedded --model PATH``; see ``server.py`` for the
routes, ``scheduler.py`` for batching and pausing, ``sampler.py`` for the decode loop
and the logprob convention, ``weights.py`` for weight updates.
"""
