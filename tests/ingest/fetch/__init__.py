"""Tests of ingest/fetch."""
