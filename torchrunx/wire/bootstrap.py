"""The bootstrap: launcher -> agent, one JSON line on the agent's stdin, before any connection.

It travels before the agent has connected (the handshake needs its secret), so it is plain
JSON, never pickled, and every field is checked when it is read.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

from torchrunx.errors import ProtocolError
from torchrunx.wire.frozen import field, frozen

if TYPE_CHECKING:
    from collections.abc import Mapping

SAFE_PATH_MARK = "torchrunx"
"""The value of ``PYTHONSAFEPATH`` that the agent's script sets when the user's environment has
none: Python 3.11 and later then put no working folder on ``sys.path`` (3.13's ``-c`` imports
``linecache`` before the code runs); the boot code removes the variable again, so that the
agent's workers and the processes they start have the user's own environment."""
SAVED_PYTHONPATH = "_TORCHRUNX_PYTHONPATH"
"""Where the agent's script keeps the user's ``PYTHONPATH`` while the interpreter starts with it
less the working folder (``site`` would import ``sitecustomize`` from there); the boot code
puts it back."""

# Runs inside the agent's interpreter: reads the bootstrap line (an AgentBootstrap), takes the
# launcher's sys.path from it so that torchrunx can be imported, and hands the whole line to the
# agent, which decodes and checks it (AgentBootstrap.from_json_line). With ``keep_path`` (a host
# running its own Python, ``Launcher(python=...)``, or shipped code) the entries go before the
# interpreter's own; relative ones (a shipped tree's) are taken from the working directory.
#
# Nothing is imported from the working folder (which anyone may write in, as /tmp): before
# its first import the code takes every entry that is that folder ("" for -c, which Python
# 3.10 has no -P against; PYTHONPATH's) off sys.path, comparing device and inode with only
# the built-in posix module; the launcher's entries then lose it too, unless it holds the
# torchrunx the launcher runs (``package_root``: a checkout launched from, which the user
# runs already). A worker gets the launcher's whole sys.path back before it loads the user's
# function (torchrunx.worker.worker). See docs/security.md.
#
# The line is handed over without staying behind: ``globals().pop`` takes ``b`` (which holds
# the secret) out of ``__main__`` as it passes it, so neither the agent nor its forked workers
# keep it as a global.
BOOT_CODE = (
    "import sys,posix\n"
    "def w(e,c=posix.stat('.')):\n"
    " try:s=posix.stat(e or '.')\n"
    " except (OSError,TypeError,ValueError):return False\n"
    " return (s.st_dev,s.st_ino)==(c.st_dev,c.st_ino)\n"
    "sys.path[:]=[e for e in sys.path if not w(e)]\n"
    "import os,json\n"
    f"v=os.environ;q=v.pop('{SAVED_PYTHONPATH}',None)\n"
    f"if v.get('PYTHONSAFEPATH')=='{SAFE_PATH_MARK}':del v['PYTHONSAFEPATH']\n"
    "if q:v['PYTHONPATH']=q\n"
    "elif q is not None:v.pop('PYTHONPATH',None)\n"
    "b=sys.stdin.buffer.readline();p=json.loads(b);r=p.get('package_root');r=bool(r) and w(r)\n"
    "sys.path[:]=[e for e in [os.path.abspath(e) for e in p['sys_path']]"
    "+(sys.path if p.get('keep_path') else []) if r or not w(e)];del p,q,r,v,w\n"
    "import torchrunx.agent.agent as a;a.main(globals().pop('b'))"
)

AGENT_COMMAND = """bash --noprofile --norc -c 'IFS= read -r -d "" s && eval "$s"'"""
"""The only command line an agent is started with (constant, holds no values): the launcher's
transports run it, and so does a relay that starts its children (tree start)."""

PYTHONPATH_WITHOUT_CWD = (
    '{ _torchrunx_r="${PYTHONPATH-}:" _torchrunx_p=; while [ -n "$_torchrunx_r" ]; do '
    "_torchrunx_e=${_torchrunx_r%%:*}; _torchrunx_r=${_torchrunx_r#*:}; "
    '[ -z "$_torchrunx_e" ] || [ "$_torchrunx_e" -ef . ] || '
    "_torchrunx_p=$_torchrunx_p${_torchrunx_p:+:}$_torchrunx_e; done; }"
)
"""The agent's script's step that sets ``_torchrunx_p`` to ``PYTHONPATH`` less its entries that
are the working folder (``""``, ``"."`` or its path, by device and inode: ``-ef``): ``site``
would import ``sitecustomize`` from there as the interpreter starts, before the boot code."""
SAFE_START = (
    f'PYTHONSAFEPATH="${{PYTHONSAFEPATH:-{SAFE_PATH_MARK}}}" '
    f'{SAVED_PYTHONPATH}="${{PYTHONPATH-}}" PYTHONPATH="$_torchrunx_p"'
)
"""What goes before ``exec PYTHON -u -c BOOT`` in the agent's script: that ``PYTHONPATH``, the
user's kept aside, and ``PYTHONSAFEPATH`` (no working folder on ``sys.path``: Python 3.11 and
later) unless the user set it. The boot code does the rest (Python 3.10's ``""`` on
``sys.path``) and puts both variables back as they were, before the agent forks a worker."""


def agent_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for an agent's interpreter started by Python (a relay's child).

    As the agent's script does, and for the same reason (no working folder on ``sys.path``):
    ``PYTHONSAFEPATH`` is set to :data:`SAFE_PATH_MARK` unless ``environ`` sets it, and
    ``PYTHONPATH`` loses the working folder, the user's kept in :data:`SAVED_PYTHONPATH`.
    """
    here = os.stat(".")  # noqa: PTH116
    kept = [entry for entry in environ.get("PYTHONPATH", "").split(":") if entry]
    kept = [entry for entry in kept if not _same_file(entry, here)]
    return {
        **environ,
        "PYTHONSAFEPATH": environ.get("PYTHONSAFEPATH") or SAFE_PATH_MARK,
        SAVED_PYTHONPATH: environ.get("PYTHONPATH", ""),
        "PYTHONPATH": ":".join(kept),
    }


def _same_file(path: str, info: os.stat_result) -> bool:
    """Whether ``path`` is the file ``info`` describes (False if it cannot be read)."""
    try:
        other = os.stat(path)  # noqa: PTH116
    except (OSError, ValueError):
        return False
    return (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino)


# The same for a relaying host (``Launcher(relay=...)``): the relay process starts first and
# runs the agent (BOOT_CODE) as its child (:mod:`torchrunx.agent.relay`).
RELAY_BOOT_CODE = BOOT_CODE.replace("torchrunx.agent.agent as", "torchrunx.agent.relay as")


COUNT_MODES = ("auto", "gpu", "cpu")
"""What an agent counts for its worker count when the launcher gave none."""


RELAY_MODES = ("", "auto", "on")
""":attr:`AgentBootstrap.relay`: none (the agent's own line), or the relay's mode."""


@frozen
class AgentTimings:
    """The host side's timings, in seconds, sent by name in the bootstrap.

    Derived from ``Launcher.agent_timeout`` once, on the launcher's side
    (:func:`torchrunx.launcher.settings.plan.agent_timings`): the agent and its workers read
    them, and derive none.
    """

    heartbeat_interval: float
    """Between the agent's heartbeats."""
    launcher_silence: float
    """Without any message from the launcher, after which the agent takes it for gone and stops
    (``agent_timeout``); also the timeout of the agent's socket to the launcher."""
    connect_timeout: float
    """For a connection to the launcher and its handshake: the agent's, and a worker's for a
    large outcome (``2 * agent_timeout``)."""
    finish_timeout: float
    """For the agent's last messages to reach the launcher and the stream to end
    (``agent_timeout``)."""
    guardian_grace: float
    """From the close of the agent's stdin until its guardian kills it, if it has not ended
    (``2 * agent_timeout + 3``: a silence noticed, then the workers stopped)."""

    def to_json(self) -> dict[str, float]:
        """The JSON object of the bootstrap's ``timings`` field."""
        return {name: getattr(self, name) for name in TIMING_FIELDS}


TIMING_FIELDS = (
    "heartbeat_interval",
    "launcher_silence",
    "connect_timeout",
    "finish_timeout",
    "guardian_grace",
)
"""The fields of :class:`AgentTimings`, in order."""


@frozen
class TreeChild:
    """A host that a relay starts in a tree start: its index, name and worker count."""

    host_index: int
    hostname: str
    workers: int | None


@frozen
class AgentBootstrap:
    """What an agent needs to find and join its launch; sent as one JSON line on its stdin.

    It travels before the agent has connected (the handshake needs :attr:`secret`), so it is
    plain JSON, never pickled: :meth:`to_json_line` writes it and :meth:`from_json_line`, run
    first thing in the agent, checks every field.
    """

    host_index: int
    """Index of the agent's host in the launcher's host list."""
    hostname: str
    """The host's name as the launcher knows it."""
    launcher_address: str
    """Address on which this host reaches the launcher's listening socket."""
    launcher_port: int
    secret: bytes = field(repr=False)
    """The per-launch secret of the handshake (hex in the JSON line)."""
    workers: int | None
    """Workers to start, or ``None`` to let the agent count them (see :attr:`count`)."""
    preload_torch: bool
    """Import ``torch.distributed`` once in the agent, before forking (not for ``backend=None``)."""
    timings: AgentTimings
    """Heartbeats, silences, timeouts and the guardian's grace (:class:`AgentTimings`)."""
    log_level: int
    """Level of the agent's root logger (``TORCHRUNX_LOG_LEVEL``)."""
    sys_path: tuple[str, ...]
    """The launcher's ``sys.path``, set by the boot code before it imports torchrunx."""
    count: str = "auto"
    """What the agent counts when ``workers`` is None: "auto" (GPUs, else CPU cores), "gpu"
    or "cpu" (``workers_per_host`` of that name)."""
    warm: bool = False
    """Stay after each run's workers end, for the next run, until a final Stop (warm agents)."""
    keep_path: bool = False
    """The host runs its own interpreter (``Launcher(python=...)``) or shipped code: ``sys_path``
    holds only the project's entries, put before the interpreter's own (its installation's)."""
    local_only: bool = False
    """Every host of the launch is the launcher's machine: host 0's rendezvous store listens on
    loopback only (:mod:`torchrunx.agent.store`); else on every interface."""
    package_root: str = ""
    """The ``sys.path`` entry that holds the launcher's torchrunx, as the host sees it (a shipped
    tree's entries are relative): the only way the working folder stays on the agent's
    ``sys.path`` (read by the boot code)."""
    preload: tuple[str, ...] = ()
    """Modules to import once before forking the workers, after torch (``TORCHRUNX_PRELOAD``)."""
    relay: str = ""
    """``Launcher(relay=...)`` for a host that relays (``"auto"`` or ``"on"``): the line goes
    first to the host's relay (:mod:`torchrunx.agent.relay`), which reads the mode and hands
    its agent the line with this field empty; ``""``: the agent's own line (left out of it)."""
    tree: tuple[TreeChild, ...] = ()
    """Tree start (``Launcher(tree_radix=...)``): the hosts this host's relay starts over SSH
    (:mod:`torchrunx.agent.tree`); the relay hands its own agent the line without them."""
    tree_script: str = field(default="", repr=False)
    """The script the children's agent command reads first (forwarded variables' values)."""
    tree_ssh_config: str = ""
    """The ``ssh -F`` file the relay starts its children with (``""``: ssh's own default)."""

    def to_json_line(self) -> bytes:
        """Encode as one line of JSON (the secret as hex), ending with a newline."""
        data: dict[str, Any] = {
            "host_index": self.host_index,
            "hostname": self.hostname,
            "launcher": [self.launcher_address, self.launcher_port],
            "secret": self.secret.hex(),
            "workers": self.workers,
            "count": self.count,
            "preload_torch": self.preload_torch,
            "timings": self.timings.to_json(),
            "log_level": self.log_level,
            "sys_path": list(self.sys_path),
            "warm": self.warm,
            "local_only": self.local_only,
            "keep_path": self.keep_path,
            "package_root": self.package_root,
        }
        if self.preload:
            data["preload"] = list(self.preload)
        if self.relay:
            data["relay"] = self.relay
        if self.tree:
            data["tree"] = [[c.host_index, c.hostname, c.workers] for c in self.tree]
            data["tree_script"] = self.tree_script
            data["tree_ssh_config"] = self.tree_ssh_config
        return json.dumps(data).encode() + b"\n"

    @classmethod
    def from_json_line(cls, line: bytes | str) -> AgentBootstrap:
        """Decode and check a line written by :meth:`to_json_line`.

        Raises:
            ProtocolError: The line is not JSON, lacks a field, has an unknown one, or a field
                has the wrong type or an impossible value; the message names the field.
        """
        try:
            data = json.loads(line)
        except ValueError as exc:  # also a UnicodeDecodeError
            raise ProtocolError(f"malformed agent bootstrap: not a line of JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ProtocolError(
                f"malformed agent bootstrap: a JSON object expected, got {type(data).__name__}"
            )
        fields = _BootstrapFields(data)
        address, port = fields.launcher()
        bootstrap = cls(
            host_index=fields.integer("host_index", minimum=0),
            hostname=fields.text("hostname"),
            launcher_address=address,
            launcher_port=port,
            secret=fields.secret("secret"),
            workers=fields.workers("workers"),
            preload_torch=fields.boolean("preload_torch"),
            timings=fields.timings("timings"),
            log_level=fields.integer("log_level", minimum=0),
            sys_path=fields.paths("sys_path"),
            count=fields.choice("count", COUNT_MODES, default="auto"),
            warm=fields.boolean("warm"),
            local_only=fields.boolean("local_only"),
            keep_path=fields.boolean("keep_path"),
            package_root=fields.path("package_root"),
            preload=fields.modules("preload"),
            relay=fields.choice("relay", RELAY_MODES, default=""),
            tree=fields.tree("tree"),
            tree_script=fields.optional_text("tree_script"),
            tree_ssh_config=fields.optional_text("tree_ssh_config"),
        )
        fields.no_others()
        return bootstrap


def is_module_name(name: str) -> bool:
    """Whether ``name`` is a dotted module name (``transformers.models``): no path, no space."""
    return all(part.isidentifier() for part in name.split("."))


def _is_child(entry: object) -> bool:
    """Whether ``entry`` is a :class:`TreeChild` as JSON: ``[index, hostname, workers]``."""
    if not isinstance(entry, list) or len(entry) != 3:
        return False
    index, hostname, workers = entry
    return (
        isinstance(index, int)
        and not isinstance(index, bool)
        and index >= 0
        and isinstance(hostname, str)
        and bool(hostname)
        and (workers is None or (isinstance(workers, int) and not isinstance(workers, bool)))
    )


class _BootstrapFields:
    """Reads the fields of a decoded bootstrap object, each checked, naming any bad one."""

    def __init__(self, data: dict[str, Any], within: str = "") -> None:
        """``within``: the field that holds ``data`` (``"timings"``), named with its fields."""
        self.data = data
        self.within = within
        self.read: set[str] = set()

    def _name(self, name: str) -> str:
        return f"{self.within}.{name}" if self.within else name

    def _get(self, name: str) -> object:
        self.read.add(name)
        if name not in self.data:
            raise ProtocolError(f"malformed agent bootstrap: field {self._name(name)!r} is missing")
        return self.data[name]

    def _bad(self, name: str, expected: str, value: object) -> ProtocolError:
        return ProtocolError(
            f"malformed agent bootstrap: field {self._name(name)!r} must be {expected}, "
            f"got {value!r}"
        )

    def integer(self, name: str, *, minimum: int) -> int:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(name, f"an integer of at least {minimum}", value)
        return value

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str) or not value:
            raise self._bad(name, "a non-empty string", value)
        return value

    def boolean(self, name: str) -> bool:
        value = self._get(name)
        if not isinstance(value, bool):
            raise self._bad(name, "true or false", value)
        return value

    def seconds(self, name: str) -> float:
        value = self._get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise self._bad(name, "a finite number of seconds above 0", value)
        return float(value)

    def timings(self, name: str) -> AgentTimings:
        value = self._get(name)
        if not isinstance(value, dict):
            raise self._bad(name, "an object of seconds", value)
        inner = _BootstrapFields(value, within=self._name(name))
        timings = AgentTimings(**{key: inner.seconds(key) for key in TIMING_FIELDS})
        inner.no_others()
        return timings

    def workers(self, name: str) -> int | None:
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad(name, "a positive integer or null", value)
        return value

    def secret(self, name: str) -> bytes:
        value = self._get(name)
        try:
            secret = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            secret = b""
        if not secret:
            raise self._bad(name, "a non-empty hex string", value)
        return secret

    def path(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str):
            raise self._bad(name, "a string", value)
        return value

    def paths(self, name: str) -> tuple[str, ...]:
        value = self._get(name)
        if not isinstance(value, list) or not all(isinstance(entry, str) for entry in value):
            raise self._bad(name, "a list of strings", value)
        return tuple(value)

    def modules(self, name: str) -> tuple[str, ...]:
        if name not in self.data:
            self.read.add(name)
            return ()
        value = self._get(name)
        if not isinstance(value, list) or not all(
            isinstance(entry, str) and is_module_name(entry) for entry in value
        ):
            raise self._bad(name, "a list of module names", value)
        return tuple(value)

    def choice(self, name: str, choices: tuple[str, ...], *, default: str) -> str:
        if name not in self.data:
            self.read.add(name)
            return default
        value = self._get(name)
        if value not in choices:
            raise self._bad(name, " or ".join(repr(choice) for choice in choices), value)
        return str(value)

    def optional_text(self, name: str) -> str:
        if name not in self.data:
            self.read.add(name)
            return ""
        return self.path(name)

    def tree(self, name: str) -> tuple[TreeChild, ...]:
        if name not in self.data:
            self.read.add(name)
            return ()
        value = self._get(name)
        if not isinstance(value, list) or not all(_is_child(entry) for entry in value):
            raise self._bad(name, "a list of [host index, hostname, workers]", value)
        return tuple(TreeChild(*entry) for entry in value)

    def launcher(self) -> tuple[str, int]:
        value = self._get("launcher")
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], str)
            or not value[0]
            or isinstance(value[1], bool)
            or not isinstance(value[1], int)
            or not 0 < value[1] < 65536
        ):
            raise self._bad("launcher", "[address, port]", value)
        return value[0], value[1]

    def no_others(self) -> None:
        unknown = sorted(self._name(name) for name in set(self.data) - self.read)
        if unknown:
            raise ProtocolError(f"malformed agent bootstrap: unknown field(s) {unknown}")
