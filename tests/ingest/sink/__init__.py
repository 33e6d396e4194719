"""Tests of ingest/sink."""
