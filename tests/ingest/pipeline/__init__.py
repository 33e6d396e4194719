"""Tests of ingest/pipeline."""
