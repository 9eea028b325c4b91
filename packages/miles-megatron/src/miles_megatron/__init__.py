"""Miles training backend on megatron-core: recipe section, CUDA check, HF conversion, layout planning.

Importing this package does not import megatron-core; the modules that need it
(``model_config``, ``gpt``) import it themselves.
"""
