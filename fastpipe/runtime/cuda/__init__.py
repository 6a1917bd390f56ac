"""CUDA machinery the processors share: issuing a run onto one stream per slot (stream_issue.py), one
CUDA-graph capture that may fail safely (capture.py), whole-run capture and replay (graph_replay.py)."""
