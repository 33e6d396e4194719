"""Outputs: the .npy array and its sidecar on S3, and the JSON records the worker emits."""
