"""Restarting a hung server: the methods, the flap guard, and the look-again before acting."""
