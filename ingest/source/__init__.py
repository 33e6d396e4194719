"""Where work comes from: S3 notifications on Kafka, consumer and producer, offsets, commits."""
