"""Generation and serving on static-cache pipelines: sampling, the KV state, the continuous-batching engine."""
