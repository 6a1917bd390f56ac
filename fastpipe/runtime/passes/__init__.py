"""Passes that rewrite a bound Program before the checker proves it: the fusion pass (fuse.py) and the
region processor's stitched-graph passes (region_graph.py, region_passes.py, region_state.py)."""
