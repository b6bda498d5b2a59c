"""The local layout and commit protocol, the manifest, checksums, DCP's writer/reader, the lease."""
