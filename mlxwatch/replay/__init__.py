"""``mlxwatch replay``: send a bundle's recorded requests again, byte for byte, to see whether the
hang comes back, and shrink them to the few that still bring it back (issue 35).

- ``options``: what a replay may be told, with its defaults
- ``server``: a server started from the bundle's recorded command line (``--launch``)
- ``session``: one replay, judged by the daemon's own rules (a front door, its ledger, the
  stall rule, the probe and the verdict policy)
- ``run``: the bundle read, the destination checked, the replay's own bundle captured
- ``shrink``: ddmin over the requests and their messages, a fresh server per trial
"""
