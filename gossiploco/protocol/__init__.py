"""The peer protocol as sans-I/O state machines: events in, actions out; no sockets, threads or clocks.

Modules, by concept:

    codec         the wire format: a msgpack header plus raw tensor frames, bytes in, bytes out
    messages      the five message kinds, the actions (``Send``, ``ServeState``), and their wire mapping
    peer_table    membership views: who is known, connected, and taking part in round r
    mailbox       bounded storage of chunks that arrive before anyone waits for them
    groups        who exchanges with whom: buckets of bounded size and their leaders, drawn per exchange; their rho
    agreement     group agreement per exchange (the bucket's leader, grace window, stragglers, aborts)
    pairing       gossip partners matched as members become ready (``[groups] pairing = "ready"``)
    ring          the ring all-reduce schedule (pure functions)
    collectives   the data calls: swap, ring all-reduce, state download (and the upload's chunks)
    call          a call's steps (``Step``) and ``run_call``, the loop a blocking driver runs them with
    node          ``PeerNode``: the state above, fed events, returning actions
    lifecycle     joining, asking rounds, catching up, stepping out: programs over a node, and ``drive``

A carrier is a *driver* around a ``PeerNode``. Its whole interface to the protocol:

1. hold one lock around every node method;
2. feed events: ``connected``/``disconnected`` when a connection to a peer comes up or drops,
   ``receive(sender, message, now)`` for each validated message (``messages.from_wire``), with
   ``sender`` authenticated by the carrier;
3. perform the returned actions: deliver each ``Send`` to its peer (``Ready``, ``Decision`` and
   ``Abort`` on a channel that does not queue behind data), answer ``ServeState`` with
   ``collectives.state_chunks`` off the receive path;
4. run exchanges as calls (``node.group_call``, ``collectives.Swap``/``RingAllReduce``/
   ``FetchState``) with ``call.run_call`` or, event-driven, by the same ``poll``/``feed`` steps,
   waking the callers after every event;
5. run the lifecycle's programs (``lifecycle.join``, ``maybe_catch_up``) with ``lifecycle.drive`` or,
   event-driven, by the same effects: a peer's joining and catching up are decided here, never in a driver.

``gossiploco.transport.zmq_exchange`` (on ``zmq_driver``) is the ZeroMQ driver; ``gossiploco.simulation`` drives the
same nodes over a simulated network and clock.
"""
