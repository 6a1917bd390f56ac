"""torch.compile of fx supertasks and regions: once per distinct graph (compile.py), tiered through one
background thread (background_compile.py), skipped where it cannot pay (compile_estimate.py), cached
between processes (compile_cache.py)."""
