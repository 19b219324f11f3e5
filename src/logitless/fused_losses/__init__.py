"""Autograd functions, the objective library and backend dispatch."""
