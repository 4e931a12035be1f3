"""Test-only Quire plugin whose platform must be refused for its API version."""
