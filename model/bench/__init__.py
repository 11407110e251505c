"""Serving benchmarks: workloads, the in-process and HTTP load generators."""
