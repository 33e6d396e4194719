"""Tests of ingest/ops."""
