"""Tuning: Optuna search per (kernel, bucket, dtype, GPU), the verified config store, runtime lookup."""
