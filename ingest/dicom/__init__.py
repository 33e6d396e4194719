"""DICOM headers: where the Pixel Data lies, what its samples mean, how its frames lie."""
