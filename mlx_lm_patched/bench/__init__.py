"""Benchmarks: ``python -m mlx_lm_patched.bench {memory,quantized,soak,all}``."""
