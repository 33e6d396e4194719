"""One object through the stages: first GET, header, reads, device, outputs."""
