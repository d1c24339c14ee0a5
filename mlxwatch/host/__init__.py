"""Seams to the host system: which process is the server, bounded subprocesses, launchctl, discovery of running servers."""
