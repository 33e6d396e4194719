"""Tests of ingest/embedded."""
