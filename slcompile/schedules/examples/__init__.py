"""Policies written as examples of what a policy is: a function from a request to steps."""
