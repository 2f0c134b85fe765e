"""A local cluster: redis-server, kvserve replicas and the SMG router as child processes."""
