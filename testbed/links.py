"""Shaped links: rate (HTB), delay and loss (netem) on the egress of (namespace, device) pairs, with ``tc``.

A link is shaped on its egresses: a veth pair's two ends shape its two directions (``netns.Star.links``
lists each peer's upload and download). ``shape_links`` replaces whatever shaping an egress had:

- a rate: an HTB class of that rate (tc counts whole Ethernet frames: at MTU 1500 one TCP flow carries
  at most 1448 / 1514 = 95.6% of it as payload) whose leaf queue is a FIFO of ``queue_packets``, or a
  netem qdisc when there is delay or loss too;
- no rate: a netem qdisc at the root (delay and/or loss only).

netem needs the kernel's sch_netem (``has_netem`` probes it); without it, ``drop_without_netem``
drops a random fraction of packets with an HTB class fed by a classic-BPF classifier (``ld rand``)
whose leaf queue holds nothing. ``clear_links`` removes all shaping.
"""

from __future__ import annotations

from collections.abc import Sequence

from testbed.netns import Unavailable, sh

Link = tuple[str, str]
"""(namespace, device): one egress."""


def clear_links(links: Sequence[Link]) -> None:
    """Remove every qdisc from each egress of ``links`` (back to the kernel's default)."""
    for ns, dev in links:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


def _netem_args(delay_ms: float, loss_pct: float, limit: int) -> list[str]:
    args = ["netem", "limit", str(limit)]
    if delay_ms > 0:
        args += ["delay", f"{delay_ms:g}ms"]
    if loss_pct > 0:
        args += ["loss", f"{loss_pct:g}%"]
    return args


def shape_links(links: Sequence[Link], rate_mbit: float | None = None, delay_ms: float = 0.0, loss_pct: float = 0.0,
                queue_packets: int = 1000, mtu: int = 1500) -> None:
    """Shape each egress of ``links`` (module docstring), replacing earlier shaping: ``rate_mbit`` (10^6 bit/s
    of Ethernet frames; None: no rate limit), ``delay_ms`` and ``loss_pct`` per direction, a queue of
    ``queue_packets`` (Linux's default txqueuelen is 1000). Raises ``Unavailable`` when netem is needed and
    the kernel lacks sch_netem."""
    limit = int(queue_packets)
    netem = delay_ms > 0 or loss_pct > 0
    if rate_mbit is None and not netem:
        raise ValueError("shape_links needs a rate, a delay or a loss")
    for ns, dev in links:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # earlier shaping, if any
        try:
            if rate_mbit is None:
                sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_netem_args(delay_ms, loss_pct, limit)])
                continue
            rate = f"{rate_mbit:g}mbit"
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
            sh(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                "rate", rate, "ceil", rate, "quantum", str(mtu + 14)])
            leaf = _netem_args(delay_ms, loss_pct, limit) if netem else ["pfifo", "limit", str(limit)]
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", *leaf])
        except RuntimeError as exc:
            if netem and "netem" in str(exc):
                raise Unavailable(f"cannot add a netem qdisc for a delay or a loss (this kernel may lack "
                                  f"sch_netem): {exc}") from exc
            raise


def drop_without_netem(links: Sequence[Link], loss_pct: float) -> None:
    """Drop a random ``loss_pct`` of each egress's packets without sch_netem (replacing earlier shaping): an HTB
    class 1:20 whose leaf queue holds nothing, fed by a classic-BPF classifier that picks a random fraction
    of packets (``ld rand``; ``jge`` threshold); the rest pass through class 1:10 at 10 Gbit/s."""
    threshold = min(2**32 - 1, int(loss_pct / 100.0 * 2**32))
    code = f"4,32 0 0 {2**32 - 4096 + 56},53 1 0 {threshold},6 0 0 {0x10020},6 0 0 0"
    for ns, dev in links:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
        sh(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"])
        sh(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "8bit",
            "ceil", "8bit"])
        sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"])
        sh(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1", "bpf",
            "bytecode", code, "classid", "1:20"])


def has_netem(ns: str, dev: str) -> bool:
    """Whether this kernel has sch_netem: a netem qdisc is added to (then removed from) ``dev`` in ``ns``, a
    device that carries nothing yet."""
    probe = sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"], check=False)
    sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return probe.returncode == 0


def qdisc_text(links: Sequence[tuple[str, str, str]]) -> str:
    """``tc qdisc show`` and ``tc class show`` of each (label, namespace, device), for the record."""
    parts = []
    for label, ns, dev in links:
        qdisc = sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip()
        cls = sh(["tc", "-n", ns, "class", "show", "dev", dev]).stdout.strip()
        parts.append(f"{label} ({ns} {dev}):\n{qdisc}\n{cls}")
    return "\n".join(parts)
