"""How the engines' OpenMP threads wait for work: briefly spinning, then asleep.

Both engines run their kernels on libgomp (torch's copy and the system's, for llama.cpp). Its
threads spin GOMP_SPINCOUNT iterations (300,000 by default) before they sleep, waiting for the
next parallel region: a core each, for milliseconds after every kernel. On a machine shared with
other work that spin takes the cores the work needs, and two engines spin against each other. On
this 2-core VM, the default model's native decode beside other busy work fell to 0.6-16 tok/s
from ~110 alone, against 23-42 with GOMP_SPINCOUNT=1000 (which alone decodes as fast as the
default: the gaps between one step's kernels are shorter than the spin); sleeping at once
(OMP_WAIT_POLICY=PASSIVE) decoded 0.7x as fast alone (`warmkv bench sharing`, docs/benchmarks.md).

libgomp reads these settings once, when it loads: they are set on import of warmkv, before torch
or llama.cpp loads, unless the user set either one (theirs wins). A process that imported torch
before warmkv keeps torch's default.
"""

from __future__ import annotations

import os

SPIN_COUNT = "1000"


if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
