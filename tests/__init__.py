"""The test suite: a package, so its helpers import as `tests.servers`, `tests.helpers`, ... (docs/testing.md)."""
