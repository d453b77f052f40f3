"""``liver chaos``: the control plane under ``kill -9``, with a checker of what must hold anyway.

Four services and a nats-server run as processes around a simulated job; a seeded schedule publishes
spot warnings and scale requests that keep the job resizing and kills a service or the server in the
middle of handoffs (:mod:`.schedule`); :mod:`.run` drives it and :mod:`.checker` decides, from the
outcomes kept in the generations stream and the job's record, whether every event ended exactly once.
"""
