"""Tensor parallelism: one model split over the ranks of a ``torch.distributed`` group (gloo on the CPU,
NCCL on GPUs).

- :mod:`~tritune.model.parallel.group`: ``init(world_size, rank, backend)`` / ``init_from_env()`` (torchrun)
  / ``teardown()``, and the collectives (:class:`~tritune.model.parallel.group.TPGroup`).
- :mod:`~tritune.model.parallel.plan`: one sharding plan per family, as data (which weight is column-,
  row-, vocab-parallel or replicated), and the shard of each role.
- :mod:`~tritune.model.parallel.model`: ``tensor_parallel(model, group)``: a rank's shard of a model, its
  family's forward with the collectives inserted.
- :mod:`~tritune.model.parallel.launch`: ``launch(n, fn, *args)`` (n spawned ranks) and ``Workers`` (ranks
  1..n-1 beside the calling process), with a watchdog that reports a dead rank's exit code.
- :mod:`~tritune.model.parallel.serving`: the scheduler on rank 0 broadcasting each step (``lead``), the
  other ranks running the same forward (``follow``).
"""
