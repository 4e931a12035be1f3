"""Test-only Quire plugin, shaped like a vendor plugin: ``plugin`` is cheap to import,
``platform`` is imported only when a platform is built."""
