"""Miles training backend on PyTorch FSDP2: Hugging Face models as they are, data parallel.

The driver-side controller is :class:`miles_fsdp.backend.FSDPBackend` (entry point
``miles.backends: fsdp``); each rank process runs :class:`miles_fsdp.rank.RankTrainer`.
The recipe section ``fsdp`` (:class:`miles_fsdp.config.FSDPOptions`) is contributed
through the ``miles_config_sections`` hook in :mod:`miles_fsdp.hooks`.
Importing this package is cheap: torch is imported by the modules that use it.
"""
