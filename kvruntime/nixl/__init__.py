"""NIXL and UCX: finding NIXL's module, one agent behind a lock, UCX's settings and
log, RDMA NICs, a cache's registration, and one NIXL READ or WRITE (transfer)."""
