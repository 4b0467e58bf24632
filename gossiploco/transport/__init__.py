"""Transports: wire codec (socket-independent); ZeroMQ and in-memory transports come next."""
