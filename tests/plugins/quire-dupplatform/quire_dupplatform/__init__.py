"""Test-only Quire plugin whose device name collides with quire-testplatform's."""
