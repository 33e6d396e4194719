"""Tests of ingest/bench."""
