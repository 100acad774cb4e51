"""The edge the control plane, the data plane and the dashboard share: I/O clients over the pure
core. `etcd_client` (the typed etcd v3 client: retries, leases, keep-alive), `overrides` (freeze
and trace requests filed in etcd, validated against the job first), `manifest` (checkpoint
manifests: build, checksum, verify), `proctitle` (each process of a job titled with its role, job
and rank)."""
