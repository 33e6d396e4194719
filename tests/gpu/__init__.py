"""Tests of gpu."""
