"""Tests of system."""
