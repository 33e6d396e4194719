"""Tests of ingest/dicom."""
