"""A peer's exchange in a companion process (``transport.companion``).

The training process keeps the model, the optimizers and the algorithm; the companion process runs the peer's
``ZmqExchange`` (its sockets, CurveZMQ and sealed encryption, protocol threads and the reductions of every
collective), so that the trainer's interpreter only asks for work and waits for it: a Mix1 in flight takes no
turn of the training thread's GIL. ``channel`` is the two-way call channel between the two processes (a pipe
between a parent and the child it started; tensors cross it in shared memory), ``host`` the companion's side,
``exchange`` the trainer's (``CompanionExchange``, what the runtime calls in place of a ``ZmqExchange``).
"""
