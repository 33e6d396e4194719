"""The embedded default: Tansu and SeaweedFS on loopback, ``demo``, ``stack``, samples."""
