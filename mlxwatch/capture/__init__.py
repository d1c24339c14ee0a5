"""Evidence bundles: capture a hung server's state before anything restarts it.

``capture_bundle`` gathers spaced py-spy stacks, CPU samples, a probe, the log tail and markers,
versions (and macOS sample/spindump/crash reports), classifies the failure and writes the
bundle atomically. The watchdog calls the same function the ``mlxwatch capture`` CLI does.
"""

from mlxwatch.capture.bundle import list_bundles, load_manifest
from mlxwatch.capture.classify import Classification, Evidence, classify
from mlxwatch.capture.collector import Bundle, CaptureRequest, capture_bundle, capture_probe_timeouts
from mlxwatch.capture.export import export_bundle

__all__ = [
    "Bundle",
    "CaptureRequest",
    "Classification",
    "Evidence",
    "capture_bundle",
    "capture_probe_timeouts",
    "classify",
    "export_bundle",
    "list_bundles",
    "load_manifest",
]
