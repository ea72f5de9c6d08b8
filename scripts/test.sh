#!/usr/bin/env bash
# Install everything a fresh Debian machine needs (system packages too), then run the linters,
# the type checker and the whole test suite. Run as root (the tests build network namespaces).
#
#   bash scripts/test.sh            # everything, as CI (.ci/run); pytest arguments may follow
#   bash scripts/test.sh --quick    # the quick tier only: pure tests and a smoke launch, ~1 min
#
# Python packages go into a virtual environment of its own (.venv, without system
# site-packages), rebuilt on every run: a dependency missing from pyproject.toml fails here on
# every machine, not only on a new one.
#
# The tests run in parallel: TORCHRUNX_TEST_WORKERS pytest-xdist workers (default 4; 0: one
# process, as `python -m pytest` runs them), `--dist loadgroup`: each worker has test hosts of
# its own, and the SLURM, Ray, framework, container and plugin tests run in groups of their own
# (tests/conftest.py; CONTRIBUTING.md, "The whole suite").
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ "${1:-}" == "--quick" ]]; then
    # The edit loop: no system package, no root; .venv reused where it exists (else made, with
    # the test extra only). `pytest -m quick`: the pure tests and the smoke launches.
    shift
    if [[ ! -x .venv/bin/python ]]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install -q torch==2.13.0
        .venv/bin/python -m pip install -q -e ".[test]"
    fi
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -m quick "$@"
fi
workers=${TORCHRUNX_TEST_WORKERS:-4}
parallel=()
if ((workers > 0)); then
    parallel=(-n "$workers" --dist loadgroup)
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# g++: DeepSpeed compiles a C++ op the first time an engine starts on a CPU. podman and
# docker.io: tests/test_containers.py. libslurm-dev, libbsd-dev, squashfs-tools: pyxis and
# enroot (tests/test_pyxis.py), built below. chromium: tests/test_cli_report.py opens the report in it (headless); tmux: tests/test_cli_top.py drives the live view in it.
apt-get install -y -qq openssh-server openssh-client iproute2 util-linux procps slurm-wlm munge iptables rsync podman chromium tmux \
    docker.io g++ make libslurm-dev libbsd-dev squashfs-tools >/dev/null
# pyxis and enroot from their git repositories where this machine has them (neither is in
# Debian, and GitHub is not reachable here); without them tests/test_pyxis.py skips, saying so.
bash scripts/build_pyxis.sh
rm -rf .venv
python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q torch==2.13.0          # CPU build; before the project, so pip keeps it
python -m pip install -q -e ".[dev]"
# The training frameworks, for tests/test_frameworks.py (which fails on CI without them).
# DeepSpeed builds from source and imports torch to do it: without build isolation it uses
# the torch above (an isolated build would download a CUDA torch of several GB).
python -m pip install -q --no-build-isolation -e ".[frameworks]"
# DeepSpeed compiles its CPU op the first time an engine starts (a minute on two cores): built
# here, once, where tests/test_frameworks.py looks for it, as part of installing DeepSpeed.
python tests/test_frameworks.py
# Ray, for tests/test_ray.py's real multi-node cluster on the namespace test hosts.
python -m pip install -q -e ".[ray]"
ruff check .
ruff format --check .
mypy
python -m pytest "${parallel[@]}" "$@"
# Mutation testing of the pure core, CI's subset (up to 15 minutes; docs/mutation.md): the
# modules changed since origin/main, else a fixed sample of every module's mutants.
python scripts/mutation.py --ci
# The benchmarks once each, small sizes, no targets asserted: they must keep working. This
# also builds benchmarks/.venv-upstream with the original torchrunx 0.4.0 from PyPI.
python benchmarks/run.py --smoke
python benchmarks/log_overhead.py --lines 2000 --runs 1
python benchmarks/timer_overhead.py --uses 20000 --runs 1
python benchmarks/stall_overhead.py --steps 100 --rounds 1
python benchmarks/hangs.py --smoke        # a sleeping rank and a mismatch, named (12-17 s)
