"""Pictures of what the backend did: DOT graphs, and more to come."""
