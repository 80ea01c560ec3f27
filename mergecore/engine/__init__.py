"""The streaming engine: the plan (groups packed into files), the merge of one group, the writers, fingerprints for cache keys."""
