"""Tests of ingest/settings."""
