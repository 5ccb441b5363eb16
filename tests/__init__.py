"""The test suite (a package, so that tests and benchmarks import ``tests.support``)."""
