"""``liver sim``: a discrete-event simulator of a training job under volatile capacity.

It replays a trace of capacity events (generated volatility regimes or a CSV file) against three
reconfiguration policies and accounts for every GPU-second: useful training, paused downtime, work lost
to a rollback, and devices held but idle. Layouts come from the real topology planner and transfer
volumes from the real transfer planner; costs come from a calibration file (``docs/simulator.md``).
"""
