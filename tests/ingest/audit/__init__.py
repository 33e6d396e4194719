"""Tests of ingest/audit."""
