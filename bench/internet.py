"""A simulated internet in Linux network namespaces, for tests that run nodes behind NAT.

Layout (``P`` is the prefix)::

    P-inet     bridge br0: the public segment 203.0.113.0/24 (documentation range)
    P-<host>   a public host, ``wan`` 203.0.113.10, .11, ... in the order given
    P-r<i>     home router i: ``wan`` 203.0.113.(20+i), ``lan`` 10.i.0.1/24, masquerade
    P-h<i>     home host i behind it: ``eth0`` 10.i.0.2/24, default route via 10.i.0.1

Only 203.0.113.0/24 and 10.0.0.0/8 are ever used. Needs root with ``ip``, ``nft`` and
``tc``; :func:`unavailable` says why not. Usage::

    with Internet("p2t1", homes=2, public_hosts=["boot"]) as net:
        subprocess.run(net.exec_prefix("h1") + ["ping", "-c1", net.ip("boot")], check=True)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence

PUBLIC_NET = "203.0.113"  # the public segment, /24

# the home router's rules, as in a consumer NAT box: outbound only, replies come back
NAT_RULES = """\
table ip nat {
  chain post {
    type nat hook postrouting priority 100;
    oifname "wan" masquerade
  }
}
table ip filter {
  chain forwarding {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }
}
"""

_NAME = re.compile(r"[A-Za-z0-9]+")
_RESERVED = re.compile(r"inet|[rh][0-9]+")


def run_cmd(argv: Sequence[str], stdin: str | None = None) -> str:
    """Run ``argv``, return its stdout; on failure raise RuntimeError naming the command
    and its stderr."""
    try:
        done = subprocess.run(list(argv), check=True, capture_output=True, text=True, input=stdin)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {e.returncode}): {e.stderr.strip()}") from None
    return done.stdout


def namespaces() -> list[str]:
    """Names of all network namespaces on this machine (``ip netns list``)."""
    return [line.split()[0] for line in run_cmd(["ip", "netns", "list"]).splitlines() if line.strip()]


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still running in namespace ``ns``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespaces(names: Sequence[str]) -> list[str]:
    """Kill the processes in, then delete, each namespace of ``names`` and its /etc/netns
    folder (best effort);
    return those still present afterwards."""
    for ns in names:
        kill_namespace_processes(ns)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)  # its hosts file, if any
    left = set(namespaces())
    return [ns for ns in names if ns in left]


def unavailable(nat: bool = True) -> str | None:
    """One line saying why the topology cannot be built here, or None when it can. Checks
    by building a throwaway namespace with a bridge, a veth pair, a tbf qdisc and nft
    (``nat``: homes behind routers; an internet of public hosts only, ``homes=0``, needs no nft)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None and (nat or tool != "nft")]
    if missing:
        return f"missing tool(s) on PATH: {', '.join(missing)}"
    ns = f"p2u-{uuid.uuid4().hex[:8]}"
    x = ["ip", "netns", "exec", ns]
    try:
        for argv in (["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"],
                     ["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"],
                     x + ["tc", "qdisc", "add", "dev", "va", "root", "tbf", "rate", "10mbit",
                          "burst", "32kbit", "latency", "400ms"],
                     *([x + ["nft", "-f", "-"]] if nat else [])):
            run_cmd(argv, stdin=NAT_RULES if argv[-1] == "-" else None)
    except (RuntimeError, OSError) as e:
        return f"cannot build network namespaces here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


class Internet:
    """Public segment, public hosts and NATed homes in network namespaces named
    ``{prefix}-...``. Built by :meth:`start` (or entering the ``with`` block), torn down by
    :meth:`close` (or leaving it, or at interpreter exit as a last resort).

    ``rate_mbit`` maps a host (a public host name or ``h<i>``) to a rate in Mbit/s that
    limits both directions of its link (tbf on its interface and on the peer's).

    ``names`` maps DNS names (``.example``, reserved for documentation) to public hosts: every
    namespace resolves them through its own hosts file (``/etc/netns/<ns>/hosts``, which
    ``ip netns exec`` mounts over /etc/hosts). libp2p counts documentation addresses as
    unroutable and announces relay addresses only under a name."""

    def __init__(self, prefix: str, homes: int = 2, public_hosts: Sequence[str] = ("boot", "pub"),
                 rate_mbit: Mapping[str, float] | None = None, names: Mapping[str, str] | None = None) -> None:
        if not _NAME.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r}: letters and digits only")
        if not 0 <= homes <= 99:
            raise ValueError(f"homes={homes}: 0 to 99")
        if len(public_hosts) > 10 or len(set(public_hosts)) != len(public_hosts):
            raise ValueError(f"public_hosts {list(public_hosts)}: at most 10, all distinct")
        for h in public_hosts:  # the bridge-side veth is named "{h}-wan", at most 15 chars
            if not _NAME.fullmatch(h) or len(h) > 11 or _RESERVED.fullmatch(h):
                raise ValueError(f"public host {h!r}: 1-11 letters/digits, not inet, r<i> or h<i>")
        self.prefix = prefix
        self.homes = homes
        self.public_hosts = list(public_hosts)
        self.rate_mbit = dict(rate_mbit or {})
        self._ip: dict[str, str] = {h: f"{PUBLIC_NET}.{10 + k}" for k, h in enumerate(self.public_hosts)}
        for i in range(1, homes + 1):
            self._ip[f"r{i}"] = f"{PUBLIC_NET}.{20 + i}"
            self._ip[f"h{i}"] = f"10.{i}.0.2"
        unknown = sorted(set(self.rate_mbit) - set(self.public_hosts) - {f"h{i}" for i in range(1, homes + 1)})
        if unknown or any(r <= 0 for r in self.rate_mbit.values()):
            raise ValueError(f"rate_mbit {self.rate_mbit}: unknown host(s) {unknown} or a rate <= 0")
        self.names = dict(names or {})
        if any(h not in self.public_hosts or not n.endswith(".example") for n, h in self.names.items()):
            raise ValueError(f"names {self.names}: NAME.example -> a public host")
        self._created: list[str] = []

    # --- names and addresses -------------------------------------------------------

    def ns(self, name: str) -> str:
        """Namespace of ``name`` ("inet", a public host, "r<i>" or "h<i>")."""
        if name != "inet" and name not in self._ip:
            raise KeyError(f"no host {name!r} in this internet")
        return f"{self.prefix}-{name}"

    def ip(self, name: str) -> str:
        """IPv4 address of ``name`` on its own link: 203.0.113.x for public hosts and routers,
        the private 10.i.0.2 for home host ``h<i>``."""
        return self._ip[name]

    def public_ip(self, name: str) -> str:
        """The address the public segment sees ``name`` as: its router's for ``h<i>``."""
        return self._ip["r" + name[1:]] if re.fullmatch(r"h[0-9]+", name) else self._ip[name]

    def exec_prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]

    # --- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> Internet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Internet:
        """Build the topology (after deleting leftovers of a crashed run with this prefix);
        on any failure tear down what was built and re-raise."""
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # keep the original error
                self.close()
            raise
        return self

    def kill_all(self) -> None:
        """SIGKILL every process still running in this internet's namespaces."""
        for ns in self._created:
            kill_namespace_processes(ns)

    def kill_host(self, name: str) -> None:
        """SIGKILL every process running on host ``name`` (a machine switched off)."""
        kill_namespace_processes(self.ns(name))

    def close(self) -> None:
        """Kill the processes in, and delete, every namespace this internet created
        (idempotent); raise RuntimeError if some namespace could not be deleted."""
        atexit.unregister(self.close)
        created, self._created = self._created, []
        left = delete_namespaces(created[::-1])
        if left:
            raise RuntimeError(f"could not delete network namespace(s) {left}")

    # --- building ------------------------------------------------------------------

    def _build(self) -> None:
        old = re.compile(re.escape(self.prefix) + r"-[A-Za-z0-9]+")
        leftovers = [ns for ns in namespaces() if old.fullmatch(ns)]
        if leftovers and delete_namespaces(leftovers):
            raise RuntimeError(f"cannot delete leftover namespaces {leftovers}")
        homes = range(1, self.homes + 1)
        for name in ["inet", *self.public_hosts, *(f"{k}{i}" for i in homes for k in "rh")]:
            run_cmd(["ip", "netns", "add", self.ns(name)])
            self._created.append(self.ns(name))
            self._ipn(name, "link", "set", "lo", "up")
            if self.names:
                os.makedirs(f"/etc/netns/{self.ns(name)}", exist_ok=True)
                with open(f"/etc/netns/{self.ns(name)}/hosts", "w") as f:
                    f.write("127.0.0.1 localhost\n" + "".join(f"{self._ip[h]} {n}\n" for n, h in self.names.items()))
        self._ipn("inet", "link", "add", "br0", "type", "bridge")
        self._ipn("inet", "link", "set", "br0", "up")
        for h in self.public_hosts:
            self._wire(h)
        for i in homes:
            r, h = f"r{i}", f"h{i}"
            self._wire(r)
            run_cmd(["ip", "link", "add", "lan", "netns", self.ns(r), "type", "veth",
                     "peer", "name", "eth0", "netns", self.ns(h)])
            self._ipn(r, "addr", "add", f"10.{i}.0.1/24", "dev", "lan")
            self._ipn(r, "link", "set", "lan", "up")
            self._ipn(h, "addr", "add", f"10.{i}.0.2/24", "dev", "eth0")
            self._ipn(h, "link", "set", "eth0", "up")
            self._ipn(h, "route", "add", "default", "via", f"10.{i}.0.1")
            run_cmd(self.exec_prefix(r) + ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
            run_cmd(self.exec_prefix(r) + ["nft", "-f", "-"], stdin=NAT_RULES)
        for name, rate in self.rate_mbit.items():
            # (namespace, interface) at each end of the host's link
            ends = [(name, "wan"), ("inet", f"{name}-wan")] if name in self.public_hosts \
                else [(name, "eth0"), ("r" + name[1:], "lan")]
            for where, dev in ends:
                run_cmd(self.exec_prefix(where) + ["tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                                   "rate", f"{rate:g}mbit", "burst", "32kbit", "latency", "400ms"])

    def reset_tcp(self, home: str) -> int:
        """Make ``home``'s router answer every forwarded TCP segment with a reset (both
        directions): its open connections break at their next segment, new ones are refused.
        Returns the rule's handle for :meth:`restore_tcp`."""
        out = run_cmd(self.exec_prefix("r" + home[1:]) + ["nft", "--echo", "--handle", "insert", "rule", "ip", "filter",
                                                           "forwarding", "meta", "l4proto", "tcp", "reject", "with",
                                                           "tcp", "reset"])
        return int(re.search(r"# handle (\d+)", out).group(1))

    def restore_tcp(self, home: str, handle: int) -> None:
        """Remove the rule :meth:`reset_tcp` inserted."""
        run_cmd(self.exec_prefix("r" + home[1:]) + ["nft", "delete", "rule", "ip", "filter", "forwarding", "handle",
                                                     str(handle)])

    def _ipn(self, name: str, *args: str) -> None:
        """``ip -n <ns of name> args...``"""
        run_cmd(["ip", "-n", self.ns(name), *args])

    def _wire(self, name: str) -> None:
        """Connect ``name`` to the public bridge: ``wan`` in its namespace, ``{name}-wan`` on br0."""
        run_cmd(["ip", "link", "add", "wan", "netns", self.ns(name), "type", "veth",
                 "peer", "name", f"{name}-wan", "netns", self.ns("inet")])
        self._ipn("inet", "link", "set", f"{name}-wan", "master", "br0", "up")
        self._ipn(name, "addr", "add", f"{self._ip[name]}/24", "dev", "wan")
        self._ipn(name, "link", "set", "wan", "up")
