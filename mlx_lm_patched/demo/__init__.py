"""The demo (``python -m mlx_lm_patched.demo``) and the tiny models the tests,
benchmarks and demo build locally: ``tiny`` (random weights, a BPE tokenizer)
and ``tiny_train`` (the demo model, trained on the standard library)."""
