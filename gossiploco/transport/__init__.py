"""Transports: the ZeroMQ driver of the protocol (``zmq_exchange`` on ``zmq_driver``, with its parts; the wire codec is ``protocol.codec``)."""
