"""Lightning (``Trainer`` and ``Fabric``): the cluster environment of a torchrunx worker.

Nothing is needed for Lightning to see a launch's ranks: every worker has
``TORCHELASTIC_RUN_ID`` set, so Lightning chooses its ``TorchElasticEnvironment``, which
reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``, before it looks at SLURM's variables (which, inside an allocation, describe
the agents, not the workers). Lightning keeps the process group torchrunx created.

:class:`TorchrunxEnvironment` is the same environment, for code that passes one explicitly
(``Trainer(plugins=[TorchrunxEnvironment()])``, as torchrunx 0.4's
``TorchrunxClusterEnvironment`` was used). It also checks ``devices`` and ``num_nodes``
against the launch and says what to pass when they do not match::

    import os

    import lightning as L
    from torchrunx.integrations.lightning import TorchrunxEnvironment

    def train() -> None:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        trainer = L.Trainer(
            devices=local,  # one process per worker of this host
            num_nodes=int(os.environ["WORLD_SIZE"]) // local,
            plugins=[TorchrunxEnvironment()],
        )

Requires the ``lightning`` package (``pip install "torchrunx[lightning]"``).
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments.torchelastic import TorchElasticEnvironment

__all__ = ["TorchrunxClusterEnvironment", "TorchrunxEnvironment"]


class TorchrunxEnvironment(TorchElasticEnvironment):
    """Lightning's ``ClusterEnvironment`` for a worker started by torchrunx.

    Ranks, world size and the rendezvous address come from the worker's variables, as in
    Lightning's ``TorchElasticEnvironment``; processes are never started by Lightning
    (``creates_processes_externally`` is true). Lightning's own ``devices`` times
    ``num_nodes`` must equal the launch's ``WORLD_SIZE``, which needs the same number of
    workers on every host.
    """

    @staticmethod
    def detect() -> bool:
        """Whether this process is a torchrunx worker."""
        return "TORCHRUNX_RESTART_COUNT" in os.environ and "RANK" in os.environ

    def set_world_size(self, size: int) -> None:
        """Check the world size Lightning computed (``num_nodes * devices``) against the launch.

        Raises:
            ValueError: ``size`` is not ``WORLD_SIZE``.
        """
        if size != self.world_size():
            raise ValueError(_mismatch(f"devices * num_nodes = {size}"))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check Lightning's ``devices`` and ``num_nodes`` against the launch.

        Raises:
            ValueError: ``num_devices * num_nodes`` is not ``WORLD_SIZE``.
        """
        if num_devices * num_nodes != self.world_size():
            raise ValueError(_mismatch(f"devices={num_devices} * num_nodes={num_nodes}"))


TorchrunxClusterEnvironment = TorchrunxEnvironment
"""torchrunx 0.4's name for :class:`TorchrunxEnvironment`."""


def _mismatch(what: str) -> str:
    """The error for Lightning settings that do not describe this launch."""
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hint = (
        f"pass devices={local} and num_nodes={world // local}"
        if world % local == 0
        else "Lightning needs the same number of workers on every host"
    )
    return (
        f"Lightning was given {what} processes, but this launch has WORLD_SIZE={world} "
        f"(LOCAL_WORLD_SIZE={local} on this host): {hint}"
    )
