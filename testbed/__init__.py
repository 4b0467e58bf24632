"""The test bed: what the tests and the benchmarks (bench/) build real runs on. Not part of gossiploco:
product code never imports it; it imports gossiploco.

    netns.py      network namespaces, veth pairs and bridges; ``Star`` (peers on a switch); clean-up, locks
    links.py      shaped links with tc: rate (HTB), delay and loss (netem), loss without netem (BPF)
    nat.py        ``NatTestbed``: home routers doing source NAT (nftables), a carrier-grade NAT
    probes.py     link probes run inside namespaces (ring all-reduce, swap, raw TCP, byte counters)
    peers.py      gossiploco's DHT nodes and peers in namespaces; what a measured run reports
    processes.py  the process manager (``gossiploco.runtime.launch.ProcessGroup``), waits with deadlines, /proc
                  (a process table; ``resources``: memory, threads, file descriptors)
    spawned.py    Python functions as a group of spawned processes (the all-reduce benchmarks)
    machine.py    ``cpu_model``: the CPU a benchmark ran on
    file_barrier.py ``FileBarrier``: many processes begin (or end) together, through files
    outsider.py   an attacker's tools: raw ZMTP, keyless sockets, a DHT node without a validator
    overrides.py  config overrides as ``--set`` arguments (the inverse of ``cli_options.parse_sets``)

Needs the repository root importable: ``pip install -e .`` (``scripts/bootstrap.sh``) registers it; pytest
puts the root on ``sys.path`` (pyproject's ``pythonpath``).
"""
