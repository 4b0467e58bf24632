"""Runtimes that drive Algorithm 1: the one-process virtual swarm and the network peer.

Both build workers with ``common.build_trainer``, measure on the schedule of
``common.measure_due`` and summarise with ``common.make_summary``; the algorithm itself is
``gossiploco.factored``, unchanged between them.
"""
