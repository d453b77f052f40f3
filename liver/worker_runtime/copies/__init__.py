"""Peer copies: the state a node would take with it, kept in another process's host memory.

Which state needs a copy and who keeps it is decided from the model and the world alone
(:mod:`liver.reshard.redundancy`); this package moves it. After every optimizer step a background
sender (:mod:`.sender`) streams the rank's copied pieces chunk by chunk (device memory through a bounded
staging buffer) over a TCP connection to its keeper (:mod:`.keeper`), which receives into a spare buffer and
swaps it in only once complete: a keeper always holds one complete copy, marked with its iteration and
the checksum the sender took, which a recovery checks before it reads the copy. :mod:`.wire` is the
framing both agree on; :class:`.peer.PeerCopies` wires one world's senders and keepers through the
job's store.

Off the critical path: the sender reads the live state while the next step computes, and the next
update waits only until it has read it all (:meth:`.sender.CopySender.wait_read`).
"""
