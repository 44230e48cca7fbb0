"""Functional ops: each a forward kernel and its backward, launched on the active backend."""
