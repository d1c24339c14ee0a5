"""When is a server hung? The detection policy and the progress rule, decisions only."""
