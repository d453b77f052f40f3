"""``liver demo``: the whole system on one machine (embedded NATS, the four services, CPU training workers),
a live scale-in and a live scale-out, and what they cost. :mod:`.orchestrator` is the entry point."""
