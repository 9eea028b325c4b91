"""The embedded engine's fast path: a paged KV cache, chunked prefill, GPU sampling and CUDA graphs.

See ``docs/engine.md``. Modules: ``allocator`` (blocks and reference counts),
``pool`` (the KV tensors and their sizing), ``model`` (the Qwen2/Qwen3 forward over
the pool), ``sampling`` (counter-based sampling and log-probs), ``triton_kernels``
(CUDA only), ``graphs`` (CUDA graphs of the decode step), ``runner`` (device-side
request state and steps), ``scheduler`` (the batching loop). torch is imported by
the modules that need it, not here.
"""
