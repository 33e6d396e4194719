"""Tests of ingest/source."""
