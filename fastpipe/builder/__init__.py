"""Building split pipelines: the pieces a builder uses to decide how to partition a model."""
