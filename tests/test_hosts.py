"""Host and slot resolution: node lists, SLURM variables, hostfiles, lengths (pure logic).

The node-list parser is also checked against the real ``scontrol`` in ``test_slurm.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx import devices
from torchrunx.devices import device_env
from torchrunx.hosts import hostlists
from torchrunx.launcher.dryrun import describe_plan
from torchrunx.launcher.settings import resolve as hosts
from torchrunx.launcher.settings.resolve import HostSlots

SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_CPUS_PER_NODE",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_ON_NODE",
)


@pytest.fixture
def no_slurm(monkeypatch):
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node1", ["node1"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("gpu-[01-04]", ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("cpu7,gpu[1-2],login", ["cpu7", "gpu1", "gpu2", "login"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[9-10]", ["n9", "n10"]),
        ("rack[1-2]n[1,3]", ["rack1n1", "rack1n3", "rack2n1", "rack2n3"]),
        # Three brackets: the last varies fastest, then the first (as scontrol orders them).
        (
            "a[1-2]b[1-2]c[1-2]",
            ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"],
        ),
        ("a[2,1]", ["a2", "a1"]),
        ("a[1-03]", ["a1", "a2", "a3"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert hostlists.expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("node[1-", "unbalanced '\\['"),
        ("node1]", "unbalanced '\\]'"),
        ("node[]", "bad range ''"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "bad range 'a-b'"),
    ],
)
def test_expand_nodelist_errors_name_the_list(nodelist, message):
    with pytest.raises(ValueError, match=message) as info:
        hostlists.expand_nodelist(nodelist)
    assert repr(nodelist) in str(info.value)


def test_expand_counts():
    assert hostlists.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert hostlists.expand_counts("4") == [4]
    assert hostlists.expand_counts("1(x2)") == [1, 1]
    with pytest.raises(ValueError, match="expected items like 2 or 2\\(x3\\)"):
        hostlists.expand_counts("2(3)")


def test_slurm_allocation_from_the_environment():
    environ = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "cn[01-03]",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_JOB_CPUS_PER_NODE": "8(x3)",
    }
    allocation = hosts.slurm_allocation(environ)
    assert allocation.nodes == ("cn01", "cn02", "cn03")
    assert [allocation.slots(n) for n in allocation.nodes] == [2, 2, 1]
    assert allocation.cpus("cn03") == 8
    assert allocation.slots("elsewhere") is None
    # GPUs per node win over tasks per node.
    with_gpus = hosts.slurm_allocation({**environ, "SLURM_GPUS_PER_NODE": "a100:4"})
    assert [with_gpus.slots(n) for n in with_gpus.nodes] == [4, 4, 4]
    mixed = hosts.slurm_allocation({**environ, "SLURM_GPUS_PER_NODE": "a100:2,v100:1"})
    assert mixed.gpus_per_node == 3
    on_node = hosts.slurm_allocation({**environ, "SLURM_GPUS_ON_NODE": "2"})
    assert on_node.gpus_per_node == 2
    with pytest.raises(ValueError, match="describes 2 nodes but the allocation has 3"):
        hosts.slurm_allocation({**environ, "SLURM_TASKS_PER_NODE": "2(x2)"})


def test_resolve_hosts_inside_an_allocation(monkeypatch):
    environ = {
        "SLURM_JOBID": "7",
        "SLURM_NODELIST": "gpu-[1-2]",
        "SLURM_TASKS_PER_NODE": "3,1",
    }
    expected = [HostSlots("gpu-1", 3), HostSlots("gpu-2", 1)]
    assert hosts.resolve_hosts("auto", "auto", environ) == expected
    assert hosts.resolve_hosts("slurm", "slurm", environ) == expected
    assert hosts.resolve_hosts("auto", 2, environ) == [HostSlots("gpu-1", 2), HostSlots("gpu-2", 2)]
    # Explicit hosts inside an allocation: SLURM's count where the host is a node.
    assert hosts.resolve_hosts(["gpu-2", "other"], "auto", environ) == [
        HostSlots("gpu-2", 1),
        HostSlots("other", None),
    ]
    with pytest.raises(RuntimeError, match=r"\['other'\] are not nodes of SLURM job 7"):
        hosts.resolve_hosts(["gpu-2", "other"], "slurm", environ)


def test_inside_an_allocation_a_hostfiles_slots_and_gpu_or_cpu_counts_come_before_slurms(
    tmp_path, monkeypatch
):
    # Pure (it guards resolve.py in scripts/mutation.py): our parser, never scontrol.
    monkeypatch.setattr(
        hostlists, "_expand_hostnames", lambda n: tuple(hostlists.expand_nodelist(n))
    )
    environ = {"SLURM_JOBID": "7", "SLURM_NODELIST": "gpu-[1-2]", "SLURM_TASKS_PER_NODE": "3,1"}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-1 slots=2\ngpu-2\n")
    assert hosts.resolve_hosts(hostfile, "auto", environ) == [
        HostSlots("gpu-1", 2),  # the hostfile's own count
        HostSlots("gpu-2", 1),  # none there: SLURM's
    ]
    for counted in ("gpu", "cpu"):  # each agent counts its own, not SLURM's tasks
        assert hosts.resolve_hosts("auto", counted, environ) == [
            HostSlots("gpu-1", None),
            HostSlots("gpu-2", None),
        ]


@pytest.mark.parametrize("entry", [5, None, 2.0])
def test_a_one_entry_list_of_no_string_is_refused_as_a_host_name(entry):
    with pytest.raises(ValueError, match=f"invalid host name {entry}: give each host as"):
        hosts.check_hostnames([entry])


def test_resolve_hosts_outside_an_allocation(no_slurm):
    assert hosts.resolve_hosts("auto", "auto") == [HostSlots("localhost", None)]
    assert hosts.resolve_hosts(["a", "b"], 2) == [HostSlots("a", 2), HostSlots("b", 2)]
    assert hosts.resolve_hosts(["a", "b"], [1, 3]) == [HostSlots("a", 1), HostSlots("b", 3)]
    with pytest.raises(RuntimeError, match="hostnames='slurm' but no SLURM allocation"):
        hosts.resolve_hosts("slurm", "auto")
    with pytest.raises(RuntimeError, match="workers_per_host='slurm' but no SLURM allocation"):
        hosts.resolve_hosts(["localhost"], "slurm")


def test_mismatched_lengths_name_both(no_slurm, tmp_path):
    with pytest.raises(ValueError, match="3 entries but there are 2 hosts"):
        hosts.resolve_hosts(["a", "b"], [1, 2, 3])
    with pytest.raises(ValueError, match="workers_per_host has 1 entries but hostnames has 2"):
        trx.Launcher(hostnames=["a", "b"], workers_per_host=[1]).validate()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1\nc\n")
    with pytest.raises(ValueError, match="2 entries but there are 3 hosts"):
        hosts.resolve_hosts(hostfile, [1, 2])


def test_parse_hostfile():
    text = """
    # our cluster
    node1 slots=4
    node2            # counted by its agent
    node3 slots=2 max_slots=8
    node1 slots=2    # Open MPI adds repeated hosts up
    """
    assert hostlists.parse_hostfile(text) == [
        HostSlots("node1", 6),
        HostSlots("node2", None),
        HostSlots("node3", 2),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 slots=0\n", "line 1: slots must be a positive integer, got '0'"),
        ("node1\nnode2 slots=x\n", "line 2: slots must be a positive integer, got 'x'"),
        ("node1 4\n", "line 1: '4' is not a key=value option"),
        ("# nothing\n\n", "lists no host"),
    ],
)
def test_hostfile_errors_name_file_and_line(text, message):
    with pytest.raises(ValueError, match=message) as info:
        hostlists.parse_hostfile(text, "/etc/hosts.mpi")
    assert "/etc/hosts.mpi" in str(info.value)


def test_hostfile_as_hostnames(no_slurm, tmp_path, monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=4\nnode2 slots=2\n")
    expected = [HostSlots("node1", 4), HostSlots("node2", 2)]
    assert hosts.resolve_hosts(hostfile, "auto") == expected
    assert hosts.resolve_hosts(str(hostfile), "auto") == expected
    # As it arrives from the command line: a one-entry list with a slash.
    assert hosts.resolve_hosts([str(hostfile)], "auto") == expected
    # A number given by the user overrides the slots.
    assert hosts.resolve_hosts(hostfile, 1) == [HostSlots("node1", 1), HostSlots("node2", 1)]
    monkeypatch.chdir(tmp_path)
    assert hosts.resolve_hosts("hostfile", "auto") == expected
    trx.Launcher(hostnames=hostfile).validate()


def test_hostnames_string_that_is_no_file_is_explained(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"neither 'auto', a host provider \(.*slurm.*\) nor an existing hostfile.*\['node1'\]",
    ):
        trx.Launcher(hostnames="node1").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"hostfile .*missing. does not exist"):
        trx.Launcher(hostnames=Path(tmp_path / "missing")).validate()


def test_hostnames_source_is_the_one_answer(tmp_path, monkeypatch):
    source = hosts.hostnames_source
    monkeypatch.chdir(tmp_path)
    assert source("auto") == hosts.HostsSource()
    assert source(Path("pbs")) == hosts.HostsSource(hostfile=Path("pbs"))  # a path is a file
    assert source("pbs") == hosts.HostsSource(provider=("pbs", None))
    assert source(["lsf"]) == hosts.HostsSource(provider=("lsf", None))
    assert source("hostfile:/etc/h") == hosts.HostsSource(provider=("hostfile", "/etc/h"))
    assert source(["hostfile:/etc/h"]) == hosts.HostsSource(provider=("hostfile", "/etc/h"))
    assert source("node1") == hosts.HostsSource(hostfile=Path("node1"))  # a string: a file
    assert source(["node1"]) == hosts.HostsSource(names=("node1",))
    assert source(["./hosts"]) == hosts.HostsSource(hostfile=Path("./hosts"))
    assert source(("a", "b")) == hosts.HostsSource(names=("a", "b"))
    assert source([]) == hosts.HostsSource()
    # A file named like a provider is that file, as a string and from the command line.
    for name in ("pbs", "slurm"):
        (tmp_path / name).write_text("n1\n")
        assert source(name) == hosts.HostsSource(hostfile=Path(name))
        assert source([name]) == hosts.HostsSource(hostfile=Path(name))
    for wrong in (None, 3, {"a": 1}):
        with pytest.raises(TypeError, match="hostnames must be"):
            source(wrong)


def test_the_plan_keeps_what_hostnames_named_classified_once(tmp_path, monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    assert trx.Launcher(hostnames=["localhost"]).plan().hosts.source == hosts.HostsSource(
        names=("localhost",)
    )
    assert trx.Launcher(hostnames=hostfile).plan().hosts.source == hosts.HostsSource(
        hostfile=hostfile
    )
    calls: list[object] = []
    real = hosts.hostnames_source

    def counted(hostnames: object) -> hosts.HostsSource:
        calls.append(hostnames)
        return real(hostnames)

    monkeypatch.setattr(hosts, "hostnames_source", counted)
    plan = trx.Launcher(hostnames=["localhost"]).plan()
    # Once: checking the field, resolving the hosts and choosing their transport share it.
    assert calls == [["localhost"]]
    calls.clear()
    launcher = trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None)
    launcher.run(print)  # and in a launch (run checks the fields, then plans)
    assert calls == [["localhost"]]
    # Named spares too: checked and resolved with one classification.
    calls.clear()
    spared = trx.Launcher(
        hostnames=["localhost"], spare_hosts=["127.0.0.1"], restart_on=("hosts",), max_restarts=1
    ).plan()
    assert calls == [["localhost"], ["127.0.0.1"]]
    assert [h.hostname for h in spared.hosts.slots] == ["localhost", "127.0.0.1"]
    assert spared.hosts.spares == 1
    # The dry run says where the hosts came from by the plan's classification.
    described = describe_plan(
        dataclasses.replace(
            plan,
            hosts=dataclasses.replace(plan.hosts, source=hosts.HostsSource(provider=("pbs", None))),
        )
    )
    assert "hosts from: host provider pbs" in described
    assert "hosts from: the list given" in describe_plan(plan)


def test_check_hostnames(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1\n")
    for good in ("auto", "pbs", "hostfile:/nowhere", hostfile, str(hostfile), [str(hostfile)]):
        hosts.check_hostnames(good)
    hosts.check_hostnames(["node1", "user@node2", "::1"])
    with pytest.raises(ValueError, match=r"'node1' is neither 'auto', a host provider \(.*pbs"):
        hosts.check_hostnames("node1")
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"hostfile .*missing' does not exist or is not a file$"):
        hosts.check_hostnames(Path(missing))
    with pytest.raises(ValueError, match=r"does not exist.*one-entry list with '/'"):
        hosts.check_hostnames([missing])
    for empty in ([], (), None, 3):
        with pytest.raises(ValueError, match="must be a non-empty list of host names"):
            hosts.check_hostnames(empty)
    with pytest.raises(ValueError, match="invalid host name 'a b'"):
        hosts.check_hostnames(["node1", "a b"])


def test_combine_slots_keeps_the_first_order_and_sums():
    entries = [("b", 1), ("a", 2), ("b", 3), ("c", None), ("c", 1)]
    assert hostlists.combine_slots(entries) == [
        HostSlots("b", 4),
        HostSlots("a", 2),
        HostSlots("c", None),  # one entry without slots: counted by its agent
    ]
    assert hostlists.combine_slots([]) == []


@pytest.mark.parametrize(
    "name", ["/tmp/x", "../../x", "a/b", "-oProxyCommand=x", "..", "", "a\x00b", "a b"]
)
def test_what_is_no_host_name_is_refused_up_front(name, no_slurm, log_dir):
    # "/tmp/x" wrote its log to /tmp/x.log, "../../x" raised a raw UnicodeError from socket.
    message = re.escape(f"invalid host name {name!r}")
    with pytest.raises(ValueError, match=message):
        trx.Launcher(hostnames=["localhost", name], workers_per_host=1).run(print)
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts(["localhost", name], 1)
    assert list(log_dir.iterdir()) == []  # refused before anything was made


SHELL_NAMES = [
    "n1$(touch${IFS}ran)",
    "n1`touch${IFS}ran`",
    "n1;touch${IFS}ran",
    "n1|touch${IFS}ran",
    "n1&&touch${IFS}ran",
]


def test_a_host_name_with_shell_syntax_never_reaches_a_shell(
    tmp_path, monkeypatch, no_slurm, log_dir
):
    # paramiko runs an SSH config's `Match exec` command through a shell, with %h the name as
    # given: each of these names ran `touch ran` there before it was refused (found in #42).
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ssh_config"
    config.write_text('Match exec "true %h"\n    ConnectTimeout 1\n')
    hostfile = tmp_path / "hostfile"
    (tmp_path / "job.py").write_text("")
    for name in SHELL_NAMES:
        hostfile.write_text(f"{name} slots=1\n")
        for given, where in (([name], "hostnames"), (hostfile, f"line 1 of {hostfile}")):
            with pytest.raises(ValueError, match=re.escape(f"{where} contains an invalid host")):
                trx.Launcher(
                    hostnames=given, workers_per_host=1, ssh_config_file=config, start_timeout=5
                ).run(print)
        done = subprocess.run(  # the command line, as a user runs it
            [
                sys.executable,
                "-m",
                "torchrunx",
                "--hostnames",
                name,
                "--ssh-config-file",
                str(config),
                "--start-timeout",
                "5",
                "--",
                "job.py",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PYTHONPATH": str(Path(trx.__file__).parent.parent)},
        )
        assert done.returncode == 2, done.stderr
        assert f"hostnames contains an invalid host name {name!r}" in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()  # no shell ever saw a name
    assert list(log_dir.iterdir()) == []  # refused before anything was made


def test_host_names_addresses_aliases_and_hostfiles_still_pass(no_slurm, tmp_path):
    names = ["user@node1", "::1", "fe80::1%eth0", "10.0.0.7", "gpu_box", "node-1.example.com"]
    names += ["[::1]", "[fe80::1%eth0]", "root@10.0.0.7", "node_1.a-b.example"]
    trx.Launcher(hostnames=names, workers_per_host=1).validate()
    assert [h.hostname for h in hosts.resolve_hosts(names, 1)] == names
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\n")
    for spec in ([str(hostfile)], f"hostfile:{hostfile}", hostfile):
        trx.Launcher(hostnames=spec).validate()  # type: ignore[arg-type]
        assert hosts.resolve_hosts(spec, "auto") == [HostSlots("node1", 2)]
    # Resolved names are checked whatever their source.
    hostfile.write_text("-x slots=2\n")
    with pytest.raises(ValueError, match="invalid host name '-x'"):
        hosts.resolve_hosts(hostfile, "auto")
    assert not hosts.is_local_host("a..b")  # socket's IDNA codec refuses it: not this machine


def test_count_local_gpus_and_slots(monkeypatch):
    assert hosts.count_local_gpus({"CUDA_VISIBLE_DEVICES": "0,3"}) == 2
    assert hosts.count_local_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == 1  # CUDA stops at -1
    cpus = len(os.sched_getaffinity(0))
    assert hosts.count_local_slots({"CUDA_VISIBLE_DEVICES": ""}) == cpus
    assert hosts.count_local_slots({"CUDA_VISIBLE_DEVICES": "-1"}) == cpus


def test_count_local_gpus_with_nvidia_smi(tmp_path, monkeypatch):
    if Path("/proc/driver/nvidia/gpus").is_dir():
        pytest.skip("this machine has an NVIDIA driver: /proc answers before nvidia-smi")
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = -L ] || exit 9\n'
        "echo 'GPU 0: NVIDIA H100 (UUID: GPU-1)'\n"
        "echo 'GPU 1: NVIDIA H100 (UUID: GPU-2)'\n"
        "echo '  MIG 1g.10gb Device 0: (UUID: MIG-3)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert hosts.count_local_gpus({}) == 2
    assert hosts.count_local_slots({}) == 2


def test_a_failing_nvidia_smi_counts_no_gpu(tmp_path, monkeypatch):
    if Path("/proc/driver/nvidia/gpus").is_dir():
        pytest.skip("this machine has an NVIDIA driver: /proc answers before nvidia-smi")
    fake = tmp_path / "nvidia-smi"  # a driver/library mismatch: it lists, then fails
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-1)'\nexit 18\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert hosts.count_local_gpus({}, kfd_nodes=tmp_path / "no-kfd") == 0


def fake_kfd(root: Path, simd_counts: list[str]) -> Path:
    """AMD's KFD topology as ``amdgpu`` writes it: one folder per node (CPU nodes: 0 SIMDs)."""
    for index, simds in enumerate(simd_counts):
        node = root / str(index)
        node.mkdir(parents=True)
        lines = ["cpu_cores_count 64", f"simd_count {simds}", "max_waves_per_simd 8"]
        (node / "properties").write_text("\n".join(lines if simds else lines[:1]) + "\n")
    return root


def test_amd_gpus_are_counted_from_the_kfd_topology(tmp_path):
    # Two CPU sockets and four MI300-like GPUs; a node without simd_count is no GPU.
    nodes = fake_kfd(tmp_path / "nodes", ["0", "0", "304", "304", "304", "304", ""])
    assert devices.count_amd_gpus(nodes) == 4
    assert devices.count_amd_gpus(tmp_path / "absent") == 0
    # ROCm's variables hide GPUs as CUDA_VISIBLE_DEVICES does, which comes first.
    assert hosts.count_local_gpus({"HIP_VISIBLE_DEVICES": "0,1"}, kfd_nodes=nodes) == 2
    assert hosts.count_local_gpus({"ROCR_VISIBLE_DEVICES": "3"}, kfd_nodes=nodes) == 1
    both = {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1,2"}
    assert hosts.count_local_gpus(both, kfd_nodes=nodes) == 1


def test_an_amd_host_gets_one_worker_per_gpu(tmp_path, monkeypatch):
    if Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi"):
        pytest.skip("this machine has NVIDIA GPUs: they answer before the KFD topology")
    nodes = fake_kfd(tmp_path / "nodes", ["0", "220", "220"])
    monkeypatch.setattr(devices, "_KFD_NODES", nodes)
    assert hosts.count_local_gpus({}) == 2
    assert hosts.count_local_slots({}) == 2  # "auto": one worker per GPU, not per CPU core


def test_device_env():
    base = {"PATH": "/bin"}
    assert device_env(
        base, local_rank=3, local_world_size=4, gpus=4, cpus=32, isolate_gpus=True
    ) == {"CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "8"}
    # Set by the user: left alone.
    user = {"CUDA_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": "2"}
    assert (
        device_env(user, local_rank=1, local_world_size=2, gpus=2, cpus=32, isolate_gpus=True) == {}
    )
    # By default every worker sees every GPU, as under torchrun.
    assert device_env(base, local_rank=1, local_world_size=2, gpus=2, cpus=4) == {
        "OMP_NUM_THREADS": "2"
    }
    # No GPU: only threads, never fewer than one.
    assert device_env(base, local_rank=0, local_world_size=8, gpus=0, cpus=2) == {
        "OMP_NUM_THREADS": "1"
    }


def _fake_resolver(monkeypatch, answer):
    """``getaddrinfo`` for made-up names: ``answer(name)`` gives an address or raises."""
    looked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(name, port, *args, **kwargs):
        if not str(name).startswith("n-"):
            return real(name, port, *args, **kwargs)  # this machine's own names
        looked.append(name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer(name), 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked


def test_a_plans_host_names_are_looked_up_each_once_and_at_the_same_time(monkeypatch):
    together = threading.Barrier(4, timeout=10)  # one after the other, the first never returns

    def answer(name):
        if name != "n-alias":
            together.wait()
        return "127.0.0.9" if name == "n-alias" else "192.0.2.7"  # loopback; TEST-NET-1

    looked = _fake_resolver(monkeypatch, answer)
    names = ["n-1", "n-2", "n-1", "localhost", "n-3", "n-alias", "192.0.2.1", "n-4", "::1"]
    assert hosts.local_hosts(names) == [False, False, False, True, False, True, False, False, True]
    assert sorted(looked) == ["n-1", "n-2", "n-3", "n-4", "n-alias"]  # each once; localhost none
    assert not [t for t in threading.enumerate() if t.name.startswith("torchrunx-resolve")]
    assert hosts.local_hosts(["n-alias"]) == [True]  # one name: looked up here, no thread
    assert hosts.local_hosts([]) == []


def test_a_plan_on_this_machines_own_names_makes_no_lookup(monkeypatch):
    """``localhost``, the kernel's host name and loopback addresses need no resolver; the
    fully qualified name (a reverse lookup: seconds each on a slow resolver, as on CI) is looked
    up once, and only when a host is not one of those."""
    fqdn_calls: list[None] = []

    def getfqdn(name: str = "") -> str:
        fqdn_calls.append(None)
        return "here.example"

    def no_lookup(*args, **kwargs):
        raise AssertionError(f"looked up {args[0]!r}")

    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getfqdn", getfqdn)
    monkeypatch.setattr(socket, "gethostbyaddr", no_lookup)
    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    own = ["localhost", socket.gethostname(), "127.0.0.1", "::1"]
    assert hosts.local_hosts(own) == [True, True, True, True]
    assert hosts.is_local_host("localhost")
    assert fqdn_calls == []
    monkeypatch.setattr(socket, "getaddrinfo", real)  # made-up names from here on
    looked = _fake_resolver(monkeypatch, lambda _name: "192.0.2.7")
    assert hosts.local_hosts(["here.example", "n-1", "n-2"]) == [True, False, False]
    assert len(fqdn_calls) == 1 and sorted(looked) == ["n-1", "n-2"]  # the fqdn: not resolved


def test_a_lookup_that_raises_ends_the_lookups_not_begun(monkeypatch):
    monkeypatch.setattr(hosts, "LOOKUPS_AT_ONCE", 1)
    released = threading.Event()

    def answer(name):
        if name == "n-0":
            raise KeyboardInterrupt  # as Ctrl-C would, in the middle of the lookups
        released.wait(10)  # the next lookup is under way while the error is raised
        return "192.0.2.7"

    looked = _fake_resolver(monkeypatch, answer)
    with pytest.raises(KeyboardInterrupt):
        hosts.local_hosts([f"n-{i}" for i in range(50)])
    released.set()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("torchrunx-resolve") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a lookup thread did not end"
        time.sleep(0.01)
    assert looked in (["n-0"], ["n-0", "n-1"])  # the 48 or 49 others never began
