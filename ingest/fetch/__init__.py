"""Reading S3 objects: range plans, GETs in threads, the ring of host slots, source digests."""
