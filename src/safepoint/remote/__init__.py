"""Object stores: the generic fsspec path, S3, transfers, retries and the remote lease."""
