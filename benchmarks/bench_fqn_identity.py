"""data/fqn_cache._identity on a model of 1,500 Linear modules (3,000 parameters) and one Adam: run it once
with PYTHONPATH naming each tree to compare (interleaved, docs/benchmarks.md)."""

import os
import timeit

import torch
from torch import nn

from safepoint.data import fqn_cache

m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1500)])
o = torch.optim.Adam(m.parameters())
n = 200
t = min(timeit.repeat(lambda: fqn_cache._identity(m, [o]), number=n, repeat=5)) / n
load = os.getloadavg()[0]
print(f"{fqn_cache.__file__}: _identity {t * 1e6:.0f} us (1500 modules, 3000 params), load {load:.1f}")
