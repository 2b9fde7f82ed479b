"""Makes a Python process "another machine", whose k-means comes out otherwise (the same clusters
in reverse order), for the tests that every process trains on the run's shard plan and not on
one of its own. Python runs this at start-up when this folder is on PYTHONPATH: tests put it
there for one `diloco worker`, or for a torchrun job where it applies to rank 1 only."""

import os

if os.environ.get("RANK", "1") == "1":
    from diloco.data import shards

    _own = shards.kmeans_groups
    shards.kmeans_groups = lambda texts, k, seed: _own(texts, k, seed)[::-1]
