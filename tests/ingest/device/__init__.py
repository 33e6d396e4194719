"""Tests of ingest/device."""
