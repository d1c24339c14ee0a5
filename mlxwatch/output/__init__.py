"""Output for people: one renderer per command family."""
