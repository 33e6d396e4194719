"""Running the worker: health endpoints and the supervisor of several worker processes."""
