"""Helpers shared by the test suite: tiny models and training (train), object-store endpoints on loopback
(s3: moto and its fault proxy; stores: fake-gcs-server and Azurite), torchrun launches (torchrun, launch)
and the child processes tests start (procs/)."""
