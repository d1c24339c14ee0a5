"""Loaded first in a test lab server started with a load delay (``LabServer.launch(load_delay=)``).

It sleeps like a big model's load (the process exists, nothing listens yet), then runs the demo
lab's own ``sitecustomize`` (the fault injector), named by ``MLXWATCH_LAB_NEXT_SITECUSTOMIZE``.
Stdlib only: it runs under the server's interpreter.
"""

import os
import runpy
import time

time.sleep(float(os.environ.get("MLXWATCH_LAB_LOAD_DELAY") or 0))
runpy.run_path(os.environ["MLXWATCH_LAB_NEXT_SITECUSTOMIZE"], run_name="sitecustomize")
