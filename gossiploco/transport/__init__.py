"""Transports: the wire codec (socket-independent) and the ZeroMQ driver of the protocol (``zmq_exchange`` over ``zmq_sockets``, the only zmq importers)."""
