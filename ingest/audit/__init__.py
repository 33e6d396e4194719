"""The audit trail: sealed, hash-chained records, their publication, decryption and verification."""
