"""Helpers shared by the test suite (tests_py/) and the bench scripts (bench/): neither imports the other."""
