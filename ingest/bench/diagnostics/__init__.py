"""Diagnostics: runnable programs, each answering one question about time or memory.

Run one from a checkout as ``python -m ingest.bench.diagnostics.NAME``; its docstring says
what it measures and how to read it.
"""
