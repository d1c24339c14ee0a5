"""The daemon: a supervisor running one watcher per instance (probe, judge, capture, restart), notify, status and metrics."""
