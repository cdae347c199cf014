"""Spreading requests over replicas of the engine (the simulator's cluster and the HTTP router)."""
