"""dicom-ingest: S3 notifications in, preprocessed DICOM pixels on the GPU and in S3 out."""
