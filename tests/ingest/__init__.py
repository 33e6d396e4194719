"""Tests of ingest."""
