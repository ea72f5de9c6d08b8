"""Rules of how each host's agent starts (``start_methods``), on made-up machine facts (pure).

The facts that ``start_methods`` reads from the machine are given here: the SLURM variables
(through the environment), whether ``srun`` is installed (``shutil.which``) and which names are
this machine (``is_local_host``). No process starts and no name is resolved.
"""

from __future__ import annotations

import pytest

from torchrunx.errors import SlurmError
from torchrunx.launcher.settings import plan
from torchrunx.launcher.settings.plan import start_methods

HERE = "localhost"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """This machine: ``localhost`` is it, every other name is remote; no SLURM job, no srun."""
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(plan, "is_local_host", lambda host: host == HERE)
    installed: set[str] = set()
    monkeypatch.setattr(
        plan.shutil, "which", lambda name: f"/usr/bin/{name}" if name in installed else None
    )

    class Machine:
        @staticmethod
        def allocation(nodes: str, job: str = "42", variable: str = "SLURM_JOB_ID") -> None:
            monkeypatch.setenv(variable, job)
            monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)

        @staticmethod
        def install(name: str) -> None:
            installed.add(name)

    return Machine


def test_rule_srun_starts_the_remote_nodes_of_the_allocation_and_this_machine_locally(machine):
    machine.allocation("n[1-3]")
    machine.install("srun")
    assert start_methods("srun", [HERE, "n1", "n3"]) == (["local", "srun", "srun"], None)
    assert start_methods("srun", ["n2"]) == (["srun"], None)


def test_rule_srun_outside_an_allocation_is_a_slurm_error_naming_agent_start(machine):
    machine.install("srun")
    with pytest.raises(
        SlurmError,
        match=r"^agent_start='srun' but no SLURM allocation was detected \(SLURM_JOB_ID and ",
    ):
        start_methods("srun", ["n1"])


def test_rule_srun_not_installed_is_a_slurm_error(machine):
    machine.allocation("n[1-2]")
    with pytest.raises(SlurmError) as raised:
        start_methods("srun", ["n1"])
    assert str(raised.value) == "agent_start='srun' but srun is not installed on this machine"


def test_rule_srun_for_a_host_outside_the_allocation_names_it_the_job_and_its_nodes(machine):
    machine.allocation("n[1-2]", job="77")
    machine.install("srun")
    with pytest.raises(SlurmError) as raised:
        start_methods("srun", [HERE, "n1", "m9", "n2", "m8"])
    assert str(raised.value) == (
        "agent_start='srun' but ['m9', 'm8'] are not nodes of SLURM job 77 (['n1', 'n2']); "
        "use agent_start='ssh'"
    )


def test_rule_srun_on_this_machine_alone_still_needs_an_allocation_and_srun(machine):
    with pytest.raises(SlurmError, match="no SLURM allocation was detected"):
        start_methods("srun", [HERE])
    machine.allocation("n1")
    with pytest.raises(SlurmError, match="srun is not installed"):
        start_methods("srun", [HERE])
    machine.install("srun")
    assert start_methods("srun", [HERE]) == (["local"], None)  # this machine is never srun's


def test_rule_auto_in_an_allocation_with_srun_starts_its_nodes_through_srun(machine):
    machine.allocation("n[1-4]", variable="SLURM_JOBID")  # the older name of the job's id
    machine.install("srun")
    assert start_methods("auto", [HERE, "n4", "n2"]) == (["local", "srun", "srun"], None)
    assert start_methods("auto", ["n1"], paired=None) == (["srun"], None)
    assert start_methods("auto", ["n1"], paired="") == (["srun"], None)  # no provider's pair


def test_rule_auto_with_one_remote_host_outside_the_allocation_is_ssh_for_every_remote(machine):
    machine.allocation("n[1-2]")
    machine.install("srun")
    assert start_methods("auto", [HERE, "n1", "m1"]) == (["local", "ssh", "ssh"], None)
    assert start_methods("auto", ["m1", "n2"]) == (["ssh", "ssh"], None)


def test_rule_auto_without_srun_or_outside_an_allocation_is_ssh(machine):
    machine.allocation("n[1-2]")
    assert start_methods("auto", [HERE, "n1"]) == (["local", "ssh"], None)  # no srun
    machine.install("scontrol")  # another SLURM command is no srun
    assert start_methods("auto", ["n1", "n2"]) == (["ssh", "ssh"], None)


def test_rule_auto_outside_an_allocation_is_ssh_even_with_srun_installed(machine, monkeypatch):
    machine.install("srun")
    assert start_methods("auto", [HERE, "n1"]) == (["local", "ssh"], None)
    monkeypatch.setenv("SLURM_JOB_ID", "5")  # a job id without a node list: no allocation
    assert start_methods("auto", ["n1"]) == (["ssh"], None)


def test_rule_auto_on_this_machine_alone_never_reads_the_allocation(machine):
    machine.allocation("not a host name!")  # would be refused if it were read
    machine.install("srun")
    assert start_methods("auto", [HERE, HERE]) == (["local", "local"], None)
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        start_methods("auto", [HERE, "n1"])  # a remote host: the node list is read


def test_rule_ssh_is_ssh_inside_an_allocation_too(machine):
    machine.allocation("n[1-2]")
    machine.install("srun")
    assert start_methods("ssh", [HERE, "n1", "n2"]) == (["local", "ssh", "ssh"], None)
    assert start_methods("ssh", [], None) == ([], None)


def test_rule_a_transport_with_an_argument_keeps_it_and_an_empty_one_is_given_as_empty(machine):
    assert start_methods("ray:", ["n1"]) == (["ray"], "")
    assert start_methods("kubectl:a:b", ["n1", HERE]) == (["kubectl", "kubectl"], "a:b")
    assert start_methods("auto", ["n1"], "kubectl:namespace=ml") == (["kubectl"], "namespace=ml")
    assert start_methods("ssh", ["n1"], "kubectl:namespace=ml") == (["ssh"], None)


def test_rule_a_relay_other_than_off_auto_on_is_refused_with_what_auto_means():
    with pytest.raises(ValueError, match=r"^relay=") as raised:
        plan.check_relay("always")
    assert str(raised.value) == (
        "relay='always': expected one of 'off', 'auto', 'on' (\"auto\" relays only for hosts "
        "that cannot open a connection to the launcher)"
    )
