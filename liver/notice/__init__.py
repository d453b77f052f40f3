"""Preemption notices from the platforms, turned into validated ``spot.warning`` events.

One agent per node (a DaemonSet or a sidecar) watches what its platform says about the node it runs on
and publishes one ``spot.warning`` per notice, with an event id derived from the notice itself: the same
notice seen twice (by two polls, or by an agent restarted in between) is the same event, which JetStream
(``Nats-Msg-Id``) and the ingester both de-duplicate. ``model`` is what every source reports, ``aws``
the EC2 instance metadata source, ``agent`` the loop, ``publish`` the one way an event goes on the bus.
"""
