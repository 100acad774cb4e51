"""Fixtures for SQL stores."""
