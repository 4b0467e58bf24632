"""Transports: the wire codec (socket-independent) and the ZeroMQ exchange (``zmq_exchange``, the only zmq importer)."""
