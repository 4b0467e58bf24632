"""Trust: who a peer is (``identity``), what makes a run private (``swarm_key``) and whom the data
plane lets in (``trust``). Which DHT records are believed is decided beside the records themselves
(``gossiploco.membership.record_validator``), with these keys.

A private run (the default) protects, against anyone without its swarm key: the confidentiality
of its DHT records and of every tensor on the data plane (CurveZMQ), its membership (nobody joins,
connects, or is mixed without the key), and the integrity of its records and protocol messages
(each signed by, or authenticated as, the peer it concerns). It does not protect against a swarm
key holder who misbehaves, nor does an open run (``--open``) protect membership at all.
"""
