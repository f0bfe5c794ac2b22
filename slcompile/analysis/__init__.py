"""Analyses: pure functions of a graph that return plain records and never change it."""
