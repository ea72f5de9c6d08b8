"""A throwaway cluster of SSH "hosts" on this machine, built from Linux network namespaces.

Each test host is a network namespace (``trx-node1``, ...) joined to a bridge (``trxbr0``) in the
root namespace by a veth pair. Each runs its own OpenSSH ``sshd`` in private mount and UTS
namespaces, so that it has its own hostname (``node1``) and its own ``/etc/hosts``, in which that
name resolves to the host's own address. The root ``/etc/hosts`` gets the test host names too, so
that a launcher in the root namespace can reach them by name.

Every name and address comes from a :class:`Profile`. Four profiles exist, with disjoint names,
links, subnets and ``/etc/hosts`` markers, so that one cluster of each can run at the same time:
``"test"`` (``node1``... on ``10.200.0``, for the test suite), ``"bench"`` (``bnode1``... on
``10.201.0``, for ``benchmarks/``), ``"slurm"`` (``snode1``... on ``10.202.0``, the hosts under
the SLURM cluster of ``slurm_cluster.py``) and ``"ray"`` (``rnode1``... on ``10.203.0``, the
nodes of the Ray cluster of ``ray_cluster.py``). Only one cluster per profile can exist on a machine at
a time; but under pytest-xdist every worker has its own copy of the ``"test"`` and ``"reach"``
profiles (:func:`worker_profile`: worker 1's hosts are ``w1node1``... on ``10.211.0``), so that the
workers' clusters run side by side. Starting a cluster first removes whatever a crashed earlier run of the same profile left
behind. Requires root (see :func:`cluster_unavailable_reason`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from collections.abc import Iterator

SSHD = Path("/usr/sbin/sshd")
ETC_HOSTS = Path("/etc/hosts")
ETC_HOSTNAME = Path("/etc/hostname")
ETC_HOSTS_LOCK = Path("/run/torchrunx-cluster.lock")
"""Lock file held while any profile reads and rewrites the root ``/etc/hosts``."""
MAX_HOSTS = 99
"""Host addresses are ``.11`` to ``.109``, clear of the launcher and the unreachable address."""

ProfileName = Literal["test", "bench", "slurm", "ray", "reach"]

CHECKOUT = Path(__file__).resolve().parent.parent
"""The project's checkout (hidden on isolated hosts)."""
HOST_VENV = Path("/mnt/venv")
"""On an isolated host: the launcher's virtual environment, outside the (hidden) checkout."""


@dataclass(frozen=True)
class Profile:
    """The names and addresses of one kind of cluster; clusters of different profiles coexist.

    Attributes:
        name: The profile's name, as given to :func:`start_cluster`.
        netns_prefix: Prefix of the hosts' network namespace names, e.g. ``"trx-"``.
        bridge: Name of the bridge in the root namespace, e.g. ``"trxbr0"``.
        veth_prefix: Prefix of the root ends of the veth pairs, e.g. ``"trxv"`` (``trxv1``...).
        subnet: First three octets of the IPv4 /24 subnet, e.g. ``"10.200.0"``.
        host_prefix: Prefix of the host names, e.g. ``"node"`` (``node1``...).
        launcher_name: Name of the root namespace's bridge address (``.1``).
        unreachable_name: SSH config alias of an address with no host behind it (``.250``).
        hosts_marker: Trailing comment on every line this profile adds to the root
            ``/etc/hosts``.
    """

    name: ProfileName
    netns_prefix: str
    bridge: str
    veth_prefix: str
    subnet: str
    host_prefix: str
    launcher_name: str
    unreachable_name: str
    hosts_marker: str

    @property
    def launcher_address(self) -> str:
        """Address of the root namespace on the bridge."""
        return f"{self.subnet}.1"

    @property
    def unreachable_address(self) -> str:
        """An address on the subnet with no host behind it."""
        return f"{self.subnet}.250"

    def host(self, i: int) -> TestHost:
        """Describe host number ``i`` (1-based)."""
        name = f"{self.host_prefix}{i}"
        return TestHost(
            name=name,
            address=f"{self.subnet}.{10 + i}",
            netns=f"{self.netns_prefix}{name}",
            veth=f"{self.veth_prefix}{i}",
        )

    def owns_link(self, link: str) -> bool:
        """Whether a root-namespace link name is this profile's bridge or one of its veths."""
        return (
            re.fullmatch(rf"{re.escape(self.bridge)}|{re.escape(self.veth_prefix)}\d+", link)
            is not None
        )

    def is_marked(self, line: bytes) -> bool:
        """Whether an ``/etc/hosts`` line was added by this profile."""
        return line.rstrip().endswith(self.hosts_marker.encode())


PROFILES: dict[str, Profile] = {
    "test": Profile(
        name="test",
        netns_prefix="trx-",
        bridge="trxbr0",
        veth_prefix="trxv",
        subnet="10.200.0",
        host_prefix="node",
        launcher_name="trx-launcher",
        unreachable_name="unreachable",
        hosts_marker="# torchrunx-test-cluster",
    ),
    "bench": Profile(
        name="bench",
        netns_prefix="trb-",
        bridge="trbbr0",
        veth_prefix="trbv",
        subnet="10.201.0",
        host_prefix="bnode",
        launcher_name="trb-launcher",
        unreachable_name="bunreachable",
        hosts_marker="# torchrunx-bench-cluster",
    ),
    "slurm": Profile(
        name="slurm",
        netns_prefix="trxs-",
        bridge="trxsbr0",
        veth_prefix="trxsv",
        subnet="10.202.0",
        host_prefix="snode",
        launcher_name="trxs-launcher",
        unreachable_name="sunreachable",
        hosts_marker="# torchrunx-slurm-cluster",
    ),
    "reach": Profile(
        name="reach",
        netns_prefix="trxh-",
        bridge="trxhbr0",
        veth_prefix="trxhv",
        subnet="10.204.0",
        host_prefix="hnode",
        launcher_name="trxh-launcher",
        unreachable_name="hunreachable",
        hosts_marker="# torchrunx-reach-cluster",
    ),
    "ray": Profile(
        name="ray",
        netns_prefix="trxr-",
        bridge="trxrbr0",
        veth_prefix="trxrv",
        subnet="10.203.0",
        host_prefix="rnode",
        launcher_name="trxr-launcher",
        unreachable_name="runreachable",
        hosts_marker="# torchrunx-ray-cluster",
    ),
}
"""Every profile by name: ``"test"`` for the test suite, ``"bench"`` for ``benchmarks/``,
``"slurm"`` for the hosts of the SLURM test cluster (``slurm_cluster.py``), ``"ray"`` for the
hosts of the Ray test cluster (``ray_cluster.py``), ``"reach"`` for hosts that do not share the
launcher's files (``isolated=True``)."""

PER_WORKER: frozenset[str] = frozenset({"test", "reach"})
"""Profiles of which every pytest-xdist worker has its own (see :func:`worker_profile`); the
others (SLURM, Ray, bench) exist once on a machine, and their tests run on one worker."""


def xdist_worker() -> int | None:
    """The number of this process's pytest-xdist worker (``gw3``: 3), or ``None`` outside one.

    Read from ``PYTEST_XDIST_WORKER``, which processes started by a worker inherit (a benchmark
    run by a test).
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", worker)
    return int(match[1]) if match else None


def worker_profile(name: str, worker: int | None = None) -> Profile:
    """The profile ``name`` as pytest-xdist worker ``worker`` (default: this process's) uses it.

    Outside xdist, and for a profile not in :data:`PER_WORKER`, the profile itself. Worker ``N``'s
    copy has names, links, subnet and ``/etc/hosts`` marker of its own, so that every worker's
    cluster runs beside the others': e.g. worker 1's ``"test"`` is ``w1node1``... in the
    namespaces ``trxw1-w1node1``... on ``10.211.0`` (the third octet tells the profiles apart:
    ``"reach"`` of worker 1 is on ``10.211.4``).

    Args:
        name: A key of :data:`PROFILES`.
        worker: The worker's number; ``None`` reads ``PYTEST_XDIST_WORKER``.

    Returns:
        The profile to use.

    Raises:
        ValueError: If the worker number would leave the addresses kept for workers (0 to 44).
    """
    base = PROFILES[name]
    if worker is None:
        worker = xdist_worker()
    if worker is None or name not in PER_WORKER:
        return base
    if not 0 <= worker < 45:  # 10.210 to 10.254
        msg = f"pytest-xdist worker {worker}: at most 45 workers have test hosts of their own"
        raise ValueError(msg)
    tag = f"w{worker}"
    stem = base.netns_prefix.rstrip("-")
    return Profile(
        name=base.name,
        netns_prefix=f"{stem}{tag}-",
        bridge=f"{stem}{tag}br",
        veth_prefix=f"{stem}{tag}v",
        subnet=f"10.{210 + worker}.{int(base.subnet.split('.')[1]) - 200}",
        host_prefix=f"{tag}{base.host_prefix}",
        launcher_name=f"{stem}{tag}-launcher",
        unreachable_name=f"{tag}{base.unreachable_name}",
        hosts_marker=f"{base.hosts_marker}-{tag}",
    )


_REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname", "ssh", "ssh-keygen")


@dataclass(frozen=True)
class TestHost:
    """One test host.

    Attributes:
        name: Hostname, e.g. ``"node1"``; resolves to ``address`` everywhere.
        address: IPv4 address of the host on the test bridge, e.g. ``"10.200.0.11"``.
        netns: Name of its network namespace, e.g. ``"trx-node1"``.
        veth: Root-namespace end of its veth pair, e.g. ``"trxv1"``.
    """

    __test__: ClassVar[bool] = False  # not a pytest test class

    name: str
    address: str
    netns: str
    veth: str


class TestCluster:
    """A running set of test hosts, each with an ``sshd`` on port 22. Made by :func:`start_cluster`.

    Attributes:
        profile: The names and addresses this cluster uses.
        hosts: The test hosts, ``node1`` to ``nodeN`` (``bnode1``... in the bench profile,
            ``snode1``... in the slurm profile).
        ssh_config: ``ssh -F`` file with a ``Host`` entry for every node and for ``unreachable``
            (``bunreachable`` in the bench profile, ``sunreachable`` in the slurm profile: an
            address on the test subnet with no host behind it, ``ConnectTimeout 2``).
        bad_key_ssh_config: Same as ``ssh_config``, but with an ``IdentityFile`` that the hosts do
            not accept.
        known_hosts: ``known_hosts`` file with every host key under the host's name and address.
        identity_file: Private key that every host accepts for ``root``.
        launcher_address: Address of the root namespace on the test bridge (``trx-launcher``).
        workdir: Directory holding keys, configs and ``sshd`` logs.
    """

    __test__: ClassVar[bool] = False  # not a pytest test class

    def __init__(
        self, hosts: list[TestHost], workdir: Path, profile: Profile, *, isolated: bool = False
    ) -> None:
        """Describe a cluster; nothing is started. Use :func:`start_cluster` instead.

        Args:
            hosts: The test hosts.
            workdir: Existing directory for keys, configs and logs.
            profile: The names and addresses the cluster uses.
            isolated: Hosts that do not share the launcher's files (see :func:`start_cluster`).
        """
        self.isolated = isolated
        self.profile = profile
        self.hosts = hosts
        self.workdir = workdir
        self.launcher_address = profile.launcher_address
        self.ssh_config = workdir / "ssh_config"
        self.bad_key_ssh_config = workdir / "bad_key_ssh_config"
        self.known_hosts = workdir / "known_hosts"
        self.identity_file = workdir / "id_ed25519"
        self._authorized_keys = workdir / "authorized_keys"
        self._bad_identity_file = workdir / "id_ed25519_unauthorized"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._saved_etc_hosts: bytes | None = None
        self._profile_lock: IO[str] | None = None
        """The lock of a profile shared by separate runs (:func:`_hold_profile`), held while
        this cluster lives."""
        self._written_etc_hosts: bytes | None = None

    def names(self) -> list[str]:
        """Return the host names, in order."""
        return [host.name for host in self.hosts]

    def run_on(
        self, host: TestHost | str, argv: list[str], timeout: float = 10
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in a host's network namespace (only; not its mount or UTS namespace).

        Args:
            host: The host or its name.
            argv: Command and arguments.
            timeout: Seconds before :class:`subprocess.TimeoutExpired` is raised.

        Returns:
            The finished process, with text ``stdout`` and ``stderr``; its exit status is not
            checked.
        """
        netns = self._host(host).netns
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{netns}", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def enter_argv(self, host: TestHost | str) -> list[str]:
        """Return an argv prefix that runs a command inside a host, as its ``sshd`` sees it.

        The command joins the network, mount and UTS namespaces of the host's ``sshd``: it has the
        host's address, ``/etc/hosts`` and hostname, as a command run over SSH would. ``nsenter``
        execs the command, so a :class:`subprocess.Popen` of the result has the command's pid.

        Args:
            host: The host or its name.

        Returns:
            ``["nsenter", "--target", PID, "--net", "--mount", "--uts"]``; append the command.

        Raises:
            RuntimeError: If the host's ``sshd`` is not running.
        """
        name = self._host(host).name
        daemon = self._daemons.get(name)
        if daemon is None or daemon.poll() is not None:
            msg = f"sshd on {name} is not running"
            raise RuntimeError(msg)
        return ["nsenter", "--target", str(daemon.pid), "--net", "--mount", "--uts"]

    def cut_link(self, host: TestHost | str) -> None:
        """Take a host off the network by setting the root end of its veth pair down.

        Open connections are not reset; packets just stop flowing.

        Args:
            host: The host or its name.
        """
        run_command(["ip", "link", "set", self._host(host).veth, "down"])

    def restore_link(self, host: TestHost | str) -> None:
        """Undo :meth:`cut_link`.

        Args:
            host: The host or its name.
        """
        run_command(["ip", "link", "set", self._host(host).veth, "up"])

    def wait_ssh_ready(self, timeout: float = 10) -> None:
        """Wait until every host's ``sshd`` accepts a TCP connection and sends its banner.

        Args:
            timeout: Seconds to wait for all hosts together.

        Raises:
            RuntimeError: If an ``sshd`` exited, or a host is not ready in time.
        """
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while not _sshd_answers(host.address):
                daemon = self._daemons.get(host.name)
                if daemon is None or daemon.poll() is not None:
                    msg = f"sshd on {host.name} is not running: {self._sshd_log(host)}"
                    raise RuntimeError(msg)
                if time.monotonic() > deadline:
                    msg = f"sshd on {host.name} not ready in {timeout}s: {self._sshd_log(host)}"
                    raise RuntimeError(msg)
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop every process in the hosts, remove namespaces and links, restore ``/etc/hosts``.

        Safe to call more than once, and on a cluster that only partly started.
        """
        atexit.unregister(self.stop)
        for daemon in self._daemons.values():
            daemon.terminate()
        for daemon in self._daemons.values():
            reap_process(daemon, timeout=5)
        self._daemons.clear()
        for host in self.hosts:
            _kill_netns_processes(host.netns)
            run_command(["ip", "link", "del", host.veth], check=False)
            run_command(["ip", "netns", "del", host.netns], check=False)
        run_command(["ip", "link", "del", self.profile.bridge], check=False)
        if self._saved_etc_hosts is not None:
            self._restore_etc_hosts(self._saved_etc_hosts)
            self._saved_etc_hosts = None
        if self._profile_lock is not None:
            self._profile_lock.close()  # the next run of this profile may start its hosts
            self._profile_lock = None

    def _host(self, host: TestHost | str) -> TestHost:
        if isinstance(host, TestHost):
            return host
        for candidate in self.hosts:
            if candidate.name == host:
                return candidate
        msg = f"no test host named {host!r}"
        raise KeyError(msg)

    def _host_dir(self, host: TestHost) -> Path:
        return self.workdir / host.name

    @property
    def launcher_only(self) -> Path:
        """A folder of the launcher's that isolated hosts do not see (an empty folder there)."""
        return self.workdir / "launcher-only"

    def cache_dir(self, host: TestHost | str) -> Path:
        """An isolated host's ``~/.cache`` (its own folder, seen from the launcher)."""
        return self._host_dir(self._host(host)) / "cache"

    def _sshd_log(self, host: TestHost) -> str:
        log = self._host_dir(host) / "sshd.log"
        return log.read_text(errors="replace").strip() if log.exists() else "(no log)"

    def _start(self) -> None:
        """Create keys, configs, network and daemons, then wait for the daemons."""
        self._make_keys_and_configs()
        self._make_network()
        self._edit_etc_hosts()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for host in self.hosts:
            self._start_sshd(host)
        self.wait_ssh_ready()

    def _make_keys_and_configs(self) -> None:
        for host in self.hosts:
            self._host_dir(host).mkdir()
        _keygen_all(
            [self.identity_file, self._bad_identity_file]
            + [self._host_dir(host) / "ssh_host_ed25519_key" for host in self.hosts]
        )
        self._authorized_keys.write_text(_public_key(self.identity_file) + "\n")
        self.known_hosts.write_text(
            "".join(
                f"{host.name},{host.address} "
                f"{_public_key(self._host_dir(host) / 'ssh_host_ed25519_key')}\n"
                for host in self.hosts
            )
        )
        self.ssh_config.write_text(self._client_config(self.identity_file))
        self.bad_key_ssh_config.write_text(self._client_config(self._bad_identity_file))
        hosts_file = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n" + "".join(
            f"{line}\n" for line in _name_lines(self.profile, self.hosts)
        )
        for host in self.hosts:
            host_dir = self._host_dir(host)
            (host_dir / "hosts").write_text(hosts_file)
            (host_dir / "hostname").write_text(f"{host.name}\n")
            (host_dir / "sshd_config").write_text(
                f"Port 22\n"
                f"ListenAddress {host.address}\n"
                f"HostKey {host_dir / 'ssh_host_ed25519_key'}\n"
                f"PidFile {host_dir / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {self._authorized_keys}\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "MaxStartups 100:30:200\n"
                "MaxSessions 100\n"
                # INFO on the isolated hosts: their sshd was twice found gone (exit status 0,
                # which is also what SIGTERM gives) with nothing in its log (conftest.isolated).
                f"LogLevel {'INFO' if self.isolated else 'ERROR'}\n"
            )

    def _client_config(self, identity_file: Path) -> str:
        targets = [(host.name, host.address) for host in self.hosts]
        targets.append((self.profile.unreachable_name, self.profile.unreachable_address))
        entries = []
        for name, address in targets:
            options = [
                f"HostName {address}",
                "User root",
                "Port 22",
                f"IdentityFile {identity_file}",
                "IdentitiesOnly yes",
                f"UserKnownHostsFile {self.known_hosts}",
                "GlobalKnownHostsFile /dev/null",
                "StrictHostKeyChecking yes",
                "BatchMode yes",
            ]
            if name == self.profile.unreachable_name:
                options.append("ConnectTimeout 2")
            entries.append(f"Host {name}\n" + "".join(f"    {option}\n" for option in options))
        return "\n".join(entries)

    def _make_network(self) -> None:
        bridge = self.profile.bridge
        run_command(["ip", "link", "add", bridge, "type", "bridge"])
        run_command(["ip", "addr", "add", f"{self.profile.launcher_address}/24", "dev", bridge])
        run_command(["ip", "link", "set", bridge, "up"])
        for host in self.hosts:
            run_command(["ip", "netns", "add", host.netns])
            peer = ["peer", "name", "eth0", "netns", host.netns]
            run_command(["ip", "link", "add", host.veth, "type", "veth", *peer])
            run_command(["ip", "link", "set", host.veth, "master", bridge, "up"])
            run_command(
                ["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"]
            )
            run_command(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
            run_command(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    def _edit_etc_hosts(self) -> None:
        marker = self.profile.hosts_marker
        added = "".join(f"{line} {marker}\n" for line in _name_lines(self.profile, self.hosts))
        with _etc_hosts_lock():
            original = ETC_HOSTS.read_bytes()
            self._saved_etc_hosts = original
            separator = b"" if original.endswith(b"\n") or not original else b"\n"
            self._written_etc_hosts = original + separator + added.encode()
            # Rewrite in place: /etc/hosts may be a bind mount, which cannot be renamed over.
            ETC_HOSTS.write_bytes(self._written_etc_hosts)

    def _restore_etc_hosts(self, saved: bytes) -> None:
        """Put back ``saved`` if nobody changed the file since; else drop only our lines.

        Another profile's cluster may have added or removed its own lines meanwhile.
        """
        with _etc_hosts_lock():
            current = ETC_HOSTS.read_bytes()
            if current == self._written_etc_hosts:
                ETC_HOSTS.write_bytes(saved)
            else:
                _drop_marked_lines(self.profile)

    def _start_sshd(self, host: TestHost) -> None:
        host_dir = self._host_dir(host)
        mounts = [(host_dir / "hosts", ETC_HOSTS)]
        if ETC_HOSTNAME.exists():
            mounts.append((host_dir / "hostname", ETC_HOSTNAME))
        isolation = self._isolation(host) if self.isolated else []
        script = " && ".join(
            [f"mount --bind {shlex.quote(str(src))} {dst}" for src, dst in mounts]
            + isolation
            + [
                f"hostname {host.name}",
                f"exec {SSHD} -D -e -f {shlex.quote(str(host_dir / 'sshd_config'))}",
            ]
        )
        # nsenter and unshare exec rather than fork, so the Popen pid ends up being sshd's.
        argv = ["nsenter", f"--net=/run/netns/{host.netns}"]
        argv += ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
        with (host_dir / "sshd.log").open("wb") as log:
            self._daemons[host.name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _isolation(self, host: TestHost) -> list[str]:
        """Mounts that keep the launcher's files from a host: the checkout, and ``~/.cache``.

        The launcher's virtual environment stays reachable at :data:`HOST_VENV` (its own
        interpreter and packages; torchrunx's editable install points into the hidden checkout).
        """
        cache = self.cache_dir(host)
        cache.mkdir(exist_ok=True)
        self.launcher_only.mkdir(exist_ok=True)
        home_cache = Path.home() / ".cache"
        home_cache.mkdir(exist_ok=True)
        venv = Path(sys.prefix)
        q = shlex.quote
        return [
            f"mount -t tmpfs -o size=1m tmpfs {HOST_VENV.parent}",
            f"mkdir {HOST_VENV}",
            f"mount --bind {q(str(venv))} {HOST_VENV}",
            f"mount -t tmpfs -o size=1m,mode=0755 tmpfs {q(str(CHECKOUT))}",
            f"mount -t tmpfs -o size=1m,mode=0755 tmpfs {q(str(self.launcher_only))}",
            f"mount --bind {q(str(cache))} {q(str(home_cache))}",
            # podman's runtime (crun) refuses hybrid cgroups: the host sees cgroup v1 only.
            "{ umount /sys/fs/cgroup/unified 2>/dev/null || true; }",
        ]


def cluster_unavailable_reason() -> str | None:
    """Say why a test cluster cannot be made here.

    Returns:
        ``None`` if network namespaces can be made and the needed tools are present, else the
        reason they cannot.
    """
    if not sys.platform.startswith("linux"):
        return f"test cluster needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "test cluster needs root (network namespaces, /etc/hosts)"
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(str(SSHD))
    if missing:
        return f"test cluster needs missing tools: {', '.join(missing)}"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot make namespaces (`unshare --net --mount --uts`): {probe.stderr.strip()}"
    return None


def start_cluster(
    n: int, workdir: Path, profile: ProfileName = "test", *, isolated: bool = False
) -> TestCluster:
    """Start ``n`` test hosts, ``node1`` to ``node{n}``, and wait until each ``sshd`` accepts.

    First removes namespaces, links and ``/etc/hosts`` lines left by an earlier run of the same
    profile; another profile's cluster is left alone. The cluster is stopped at interpreter exit if
    :meth:`TestCluster.stop` was not called.

    Args:
        n: Number of hosts, 1 to 99.
        workdir: Existing, empty directory for keys, configs and logs; its path must not contain
            whitespace (it is written unquoted into ssh configs).
        profile: Which names and addresses to use (see :data:`PROFILES`): ``"test"`` (the
            default: ``node1``... on ``10.200.0``), ``"bench"`` (``bnode1``... on ``10.201.0``)
            or ``"slurm"`` (``snode1``... on ``10.202.0``).
        isolated: Hosts that do not share the launcher's files: in each host's mount
            namespace the project's checkout and :attr:`TestCluster.launcher_only` are empty
            folders, ``~/.cache`` is the host's
            own (:meth:`TestCluster.cache_dir`), and the launcher's virtual environment is at
            :data:`HOST_VENV`. ``workdir`` must lie outside the checkout.

    Returns:
        The running cluster.

    Raises:
        ValueError: If ``n``, ``workdir`` or ``profile`` is unusable.
    """
    if profile not in PROFILES:
        msg = f"profile must be one of {sorted(PROFILES)}, not {profile!r}"
        raise ValueError(msg)
    chosen = worker_profile(profile)
    if not 1 <= n <= MAX_HOSTS:
        msg = f"n must be between 1 and {MAX_HOSTS}, not {n}"
        raise ValueError(msg)
    workdir = workdir.resolve()
    if any(char.isspace() for char in str(workdir)):
        msg = f"workdir path must not contain whitespace: {workdir}"
        raise ValueError(msg)
    if isolated and workdir.is_relative_to(CHECKOUT):
        msg = f"an isolated cluster's workdir must lie outside the checkout {CHECKOUT}"
        raise ValueError(msg)
    lock = _hold_profile(chosen)
    try:
        _remove_stale_cluster(chosen)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    hosts = [chosen.host(i) for i in range(1, n + 1)]
    cluster = TestCluster(hosts, workdir, chosen, isolated=isolated)
    cluster._profile_lock = lock
    atexit.register(cluster.stop)
    try:
        cluster._start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


SHARED_PROFILES: frozenset[str] = frozenset({"bench"})
"""Profiles that separate runs use (a benchmark, and the suite's benchmark smoke tests): each
run's cluster would remove the other's as stale, so one holds the profile's lock while its
cluster lives, and the next waits (:data:`PROFILE_WAIT` at most)."""
PROFILE_WAIT = 1800.0


def _hold_profile(profile: Profile) -> IO[str] | None:
    """The lock of a profile in :data:`SHARED_PROFILES` (None for the others), once free.

    Raises:
        RuntimeError: Another run held it for :data:`PROFILE_WAIT` seconds.
    """
    if profile.name not in SHARED_PROFILES:
        return None
    path = Path(f"/run/torchrunx-cluster-{profile.name}.lock")
    handle = path.open("a")
    deadline = time.monotonic() + PROFILE_WAIT
    while not _try_lock(handle):
        if time.monotonic() > deadline:
            handle.close()
            msg = (
                f"the {profile.name} test hosts were in use by another run for "
                f"{PROFILE_WAIT:.0f} s (its lock: {path}); end that run first"
            )
            raise RuntimeError(msg)
        time.sleep(0.5)
    return handle


def _try_lock(handle: IO[str]) -> bool:
    """Whether this process now holds ``handle``'s exclusive lock (without waiting)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_stale_cluster(profile: Profile) -> None:
    """Remove the profile's namespaces with their processes, its links and marked hosts lines."""
    netns_list = run_command(["ip", "netns", "list"]).stdout.splitlines()
    for netns in (line.split()[0] for line in netns_list if line.strip()):
        if netns.startswith(profile.netns_prefix):
            _kill_netns_processes(netns)
            run_command(["ip", "netns", "del", netns])
    links = run_command(["ip", "-o", "link", "show"]).stdout.splitlines()
    for link in (line.split(": ")[1].split("@")[0] for line in links):
        if profile.owns_link(link):
            run_command(["ip", "link", "del", link], check=False)  # a veth may go with its peer
    with _etc_hosts_lock():
        _drop_marked_lines(profile)


@contextlib.contextmanager
def _etc_hosts_lock() -> Iterator[None]:
    """Hold an exclusive lock between profiles' read-modify-write cycles of ``/etc/hosts``."""
    with ETC_HOSTS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _drop_marked_lines(profile: Profile) -> None:
    """Remove the profile's marked lines from ``/etc/hosts`` (the caller holds the lock)."""
    lines = ETC_HOSTS.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if not profile.is_marked(line)]
    if kept != lines:
        ETC_HOSTS.write_bytes(b"".join(kept))


def _name_lines(profile: Profile, hosts: list[TestHost]) -> list[str]:
    """``/etc/hosts`` lines for the launcher and every host (IPv4, then IPv4-mapped IPv6)."""
    return (
        [f"{profile.launcher_address} {profile.launcher_name}"]
        + [f"{host.address} {host.name}" for host in hosts]
        + [f"::ffff:{host.address} {host.name}" for host in hosts]
    )


def run_command(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; if ``check``, raise :class:`RuntimeError` with its stderr when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        msg = f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"
        raise RuntimeError(msg)
    return result


def _keygen_all(paths: list[Path]) -> None:
    """Make unencrypted ed25519 key pairs at ``paths`` (``.pub`` alongside), concurrently."""
    procs = [
        subprocess.Popen(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for path in paths
    ]
    for path, proc in zip(paths, procs, strict=True):
        _, stderr = proc.communicate(timeout=30)
        if proc.returncode != 0:
            msg = f"ssh-keygen for {path} failed: {stderr.decode(errors='replace').strip()}"
            raise RuntimeError(msg)


def _public_key(private_key: Path) -> str:
    """Return ``"<type> <base64>"`` from the ``.pub`` file next to ``private_key``."""
    key_type, key_data = Path(f"{private_key}.pub").read_text().split()[:2]
    return f"{key_type} {key_data}"


def _sshd_answers(address: str) -> bool:
    """Whether an SSH server at ``address`` port 22 accepts a connection and sends its banner."""
    try:
        with socket.create_connection((address, 22), timeout=0.5) as sock:
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def reap_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for ``proc`` to exit, SIGKILLing it after ``timeout`` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _netns_pids(netns: str) -> list[int]:
    """Pids of live (non-zombie) processes in a network namespace."""
    result = run_command(["ip", "netns", "pids", netns], check=False)
    return [int(pid) for pid in result.stdout.split()]


def _kill_netns_processes(netns: str, grace: float = 2.0) -> None:
    """Kill every process in a network namespace: SIGTERM, then SIGKILL after ``grace`` seconds.

    Raises:
        RuntimeError: If processes survive SIGKILL for 10 seconds.
    """
    start = time.monotonic()
    while pids := _netns_pids(netns):
        elapsed = time.monotonic() - start
        if elapsed > grace + 10:
            msg = f"processes {pids} in {netns} survive SIGKILL"
            raise RuntimeError(msg)
        sig = signal.SIGTERM if elapsed < grace else signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.05)
