"""Passes over the Dynamo FX graph, one module each; the order lives in `slcompile.pipeline`."""
