"""Worker: the GPU side. GPU discovery, the resident-model manager and the process lifecycle.

Imports `placement`, never `tasks`.

Every process of the GPU side imports this package before torch, so it sets what torch's
OpenMP runtime reads when it loads: how long a thread waiting at a parallel region's
barrier spins before it sleeps (`GOMP_SPINCOUNT`, `OPENMP_SPINS`; an environment that
sets it keeps its own). libgomp's default spins about 300,000 times, which pays while a
process has its cores to itself; on a host whose cores are shared with other busy
processes (a simulated GPU's worker beside its Celery processes, Redis, its callers or
another fleet) a spinning thread holds the core its partner needs, and a barrier can
cost a time slice. See docs/worker.md, "CPU threads and pass sizes".
"""

import os

#: Spins at an OpenMP barrier before sleeping. Tuned, on the 2-core test VM: the short
#: shape's 32 calls through the fleet took 1.02-1.20 s at libgomp's default, 1.10-1.26 s
#: at 10,000, 1.25-1.37 s at 3,000 and 1.48-1.65 s at 1,000; beside another process's
#: 2-thread torch loop, a test of long generations took 97 s at the default, 17-19 s at
#: 10,000 and 14 s at 3,000 (13 s when every barrier slept).
OPENMP_SPINS = "10000"

os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPINS)
