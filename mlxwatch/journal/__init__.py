"""The records: the incident journal, the state file, and the lock on the state dir."""
