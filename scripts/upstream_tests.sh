#!/usr/bin/env bash
# Run the original torchrunx's own tests (apoorvkh/torchrunx, 0.4.0), unmodified, against this
# checkout. Their code is not part of this repository (it is GPL-3.0): give a checkout of it.
#
#   git clone https://github.com/apoorvkh/torchrunx /tmp/torchrunx-0.4
#   git -C /tmp/torchrunx-0.4 checkout b3ec4e5a9b43bc2c040bbd371054a70e412c6239  # "bump version to 0.4.0"
#   bash scripts/upstream_tests.sh /tmp/torchrunx-0.4
#
# Its tests/ folder is copied as it is into a new temporary folder, and pytest runs there, as
# the original's CI runs it (`pytest --verbose tests/test_ci.py`), with this checkout first on
# PYTHONPATH: the torchrunx imported is checked to be this checkout's, not an installed one.
# tests/test_ci.py always runs (this machine, gloo; without SLURM_*, PBS_* and LSB_* variables,
# as on the original's CI). tests/test_func.py (hostnames="slurm") runs too inside a SLURM
# allocation of 2 or more nodes, else the script says it was not run. The
# other files of the original's tests/ (test_submitit.py, test_train_gpu.py) need submitit or
# GPUs and transformers, and are not run.
#
# PYTHON: the interpreter (default: this checkout's .venv/bin/python, else python3); it needs
# torch and pytest. The exit status is 0 when every test that ran passed, else pytest's last
# failing status.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
upstream="${1:?usage: scripts/upstream_tests.sh UPSTREAM_CHECKOUT (a checkout of apoorvkh/torchrunx)}"
if [[ ! -f "$upstream/tests/test_ci.py" ]]; then
    echo "upstream_tests.sh: $upstream/tests/test_ci.py not found: give a checkout of" \
        "apoorvkh/torchrunx (see the top of this script for the commit of 0.4.0)" >&2
    exit 2
fi
upstream="$(cd "$upstream" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

imported="$("$python" -c 'import torchrunx; print(torchrunx.__file__)')"
if [[ "$imported" != "$repo/torchrunx/__init__.py" ]]; then
    echo "upstream_tests.sh: $python imports torchrunx from $imported, not from $repo:" \
        "remove that install or choose another interpreter (PYTHON=...)" >&2
    exit 2
fi
commit="$(git -C "$upstream" rev-parse HEAD 2>/dev/null || echo "not a git checkout")"
echo "upstream tests: $upstream/tests ($commit)"
echo "torchrunx under test: $repo ($("$python" -c 'import torchrunx; print(torchrunx.__version__)'))"

work="$(mktemp -d "${TMPDIR:-/tmp}/trx-upstream-tests.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -R "$upstream/tests" "$work/tests"  # unmodified; pytest's cache is off so nothing is added
mkdir "$work/tmp"
export TMPDIR="$work/tmp"  # the folders the tests make with tempfile.mkdtemp() go with it
cd "$work"  # test_ci.py's first launch writes ./torchrunx_logs: here, not in either checkout

# test_ci.py is the original's CI, run outside any allocation: there its launches (hostnames
# "auto") are on this machine, and test_logging counts this machine's files. Inside a job,
# "auto" would be the allocation (in 0.4 too), so it runs without the schedulers' variables.
scheduler_vars=()
for name in $(compgen -e); do
    case "$name" in SLURM_* | PBS_* | LSB_*) scheduler_vars+=(-u "$name") ;; esac
done
status=0
env "${scheduler_vars[@]}" "$python" -m pytest -p no:cacheprovider --verbose tests/test_ci.py ||
    status=$?
nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-0}}"
if [[ -n "${SLURM_JOB_ID:-}" && "$nodes" -ge 2 ]]; then
    "$python" -m pytest -p no:cacheprovider --verbose tests/test_func.py || status=$?
else
    echo "tests/test_func.py not run: it needs a SLURM allocation of 2 or more nodes" \
        "(SLURM_JOB_ID=${SLURM_JOB_ID:-unset}, nodes: $nodes)"
fi
exit "$status"
