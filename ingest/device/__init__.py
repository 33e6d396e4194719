"""The device stage's async side: batching chunks for the dedicated device thread (gpu/)."""
