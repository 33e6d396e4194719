"""``dicom-ingest bench``: our worker against reference readers; the diagnostics."""
