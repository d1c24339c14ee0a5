"""Interpreter-start hook for lab servers (see sitecustomize.py); not imported by mlxwatch."""
