"""The one seam to hivemind: the averagers that run a round (averaging.py, on gated.py's members-only averager with
reducer.py's bounded reducer), the codecs (compression.py), what a round's members tell each other (members.py), who
may take part (membership.py), the run's signed records (records.py), the state served to joiners (state_sync.py),
the DHT and its shared clock (dht.py), reachability and relays for units behind NAT (reachability.py, relays.py), and
the bytes on the wire (wire.py). Outside it only a unit's wiring (peer.py) and the log set-up (unit/metrics.py) touch
hivemind."""
