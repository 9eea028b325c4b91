"""A stand-in for the ``sglang`` package, found only when a test puts ``tests/engine/sglang_program`` on the path.

See ``launch_server.py``: SGLang itself needs CUDA kernels these CPU machines lack.
"""
