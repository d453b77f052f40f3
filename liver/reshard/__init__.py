"""Resharding as data: views, holdings, the transfer planner, its plans, their verifier and plan files.

One package so that a change to how state moves between layouts has one room (see ``README.md`` here);
it imports only :mod:`liver.shared`, and the services and the worker runtime import it.
"""
