"""Dynamo backends: `speedloader` (the entry point) and its lowerings."""
