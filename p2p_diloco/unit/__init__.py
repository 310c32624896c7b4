"""The learning unit: its loop and the I/O its rounds call for (unit.py), how it joins (joining.py), its inner
optimizer (inner.py), several ranks and sharding (ranks.py, sharding.py), the model and data it trains (model.py,
adapters.py, data.py), goodput (goodput.py), what it keeps out of forked children (forking.py), and what it reports
(events.py, metrics.py, tracking.py). Its checkpoints are the package's checkpoint.py."""
