#!/usr/bin/env bash
# The GPU path, on a machine with NVIDIA GPUs (CI has none): real NCCL DDP launches on this
# host and the launch benchmarks on NCCL. Needs 2 or more GPUs for the full check; with 1 GPU
# it runs the example on 1 worker, checks that "auto" falls back to gloo for 2 workers, and
# skips the benchmarks (their cases run 2 workers, each needs a GPU of its own).
#
#   bash scripts/gpu_check.sh            # prints the benchmark table at the end
#
# It makes its own virtual environment (GPU_CHECK_VENV, default /tmp/torchrunx-gpu-venv) that
# sees this machine's Python packages, so the CUDA build of torch installed here is used (else
# `pip install torch`). Offline, point pip at wheels of torchrunx's other dependencies:
# PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${GPU_CHECK_VENV:-/tmp/torchrunx-gpu-venv}"
python3 -m venv --system-site-packages "$venv"
py="$venv/bin/python"
# Where python3 is itself a virtual environment (an image's /opt/.../.venv, conda), the new one
# sees the base interpreter's packages only: a .pth file adds python3's own (its CUDA torch).
python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check-host.pth"
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q torch
"$py" -m pip install -q -e .
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
echo "torch $("$py" -c 'import torch; print(torch.__version__)'), $gpus GPU(s)"
[ "$gpus" -ge 1 ] || { echo "gpu_check: torch sees no CUDA GPU" >&2; exit 1; }
export TORCHRUNX_LOG_DIR="${TORCHRUNX_LOG_DIR:-$(mktemp -d)}"
workers=$((gpus >= 2 ? 2 : 1))

expect() {  # expect DEVICES ARGS...: run the DDP example, check the devices every rank used
    local want=$1 out
    shift
    out=$("$py" examples/01_train_ddp.py --steps 50 "$@")
    echo "$out"
    grep -qxF "devices: $want" <<<"$out" || { echo "gpu_check: expected devices: $want" >&2; exit 1; }
    grep -qxF "all ranks hold the same weights: True" <<<"$out"
}
cuda=$("$py" -c "print([f'cuda:{i}' for i in range($workers)])")
# Every worker sees every GPU, and cuda:LOCAL_RANK is current (the example checks it too).
expect "$cuda" --backend nccl --workers "$workers"
expect "$cuda" --backend auto --workers "$workers"       # auto: every worker has a GPU
cpus=$("$py" -c "print(['cpu'] * ($gpus + 1))")
expect "$cpus" --backend auto --workers $((gpus + 1))    # one worker too many: gloo for all

# isolate_gpus=True: each worker sees its own GPU only, as cuda:0, and NCCL still works.
"$py" - "$workers" <<'EOF'
import os
import sys

import torch
import torch.distributed as dist

import torchrunx as trx


def probe():
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    return visible, torch.cuda.device_count(), torch.cuda.current_device(), total.item()


if "CUDA_VISIBLE_DEVICES" in os.environ:
    print("isolate_gpus check skipped: CUDA_VISIBLE_DEVICES is set here, so it is left alone")
    sys.exit(0)
n = int(sys.argv[1])
launcher = trx.Launcher(hostnames=["localhost"], workers_per_host=n, isolate_gpus=True)
got = launcher.run(probe).ranks  # backend "auto": nccl, one GPU per worker
assert got == [(str(i), 1, 0, float(n)) for i in range(n)], got
print("isolate_gpus=True (CUDA_VISIBLE_DEVICES, device_count, current_device, sum):", got)
EOF

# torchrunx check counts this host's GPUs as an agent would, and passes a launch asking for NCCL.
out=$("$py" -m torchrunx check --hostnames localhost --backend nccl --workers-per-host gpu)
echo "$out"
want="$gpus GPU"
[ "$gpus" -ge 2 ] && want="$gpus GPUs"
grep -q "^localhost  ok    local  .*, $want, " <<<"$out" ||
    { echo "gpu_check: torchrunx check did not find $want ready" >&2; exit 1; }

# Ctrl-\ (SIGQUIT) on NCCL workers: every rank's stack printed, the launch goes on.
"$py" - "$workers" <<'EOF'
import os, signal, subprocess, sys, tempfile, time

folder = tempfile.mkdtemp()
script = f"""
import os, time, torch, torch.distributed as dist, torchrunx as trx
def hold():
    open(f"{folder}/started" + os.environ["RANK"], "w").close()
    while not os.path.exists("{folder}/go"):
        time.sleep(0.02)
    dist.barrier()
    return torch.cuda.current_device()
print("devices", trx.launch(hold, hostnames=["localhost"], workers_per_host={sys.argv[1]}, backend="nccl").ranks)
"""
p = subprocess.Popen(
    [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    preexec_fn=lambda: signal.signal(signal.SIGQUIT, signal.SIG_DFL),  # as in a terminal
)
while not all(os.path.exists(f"{folder}/started{r}") for r in range(int(sys.argv[1]))):
    assert p.poll() is None, p.communicate()
    time.sleep(0.05)
p.send_signal(signal.SIGQUIT)
time.sleep(3)
open(f"{folder}/go", "w").close()
out, err = p.communicate(timeout=120)
print(out, err[-3000:])
assert p.returncode == 0 and "where every rank is" in err, err
print("gpu_check: SIGQUIT showed every NCCL rank's stack and the launch went on")
EOF

# pdb in an NCCL rank: breakpoint() in the last rank opens pdb in this (pseudo-)terminal while
# the others wait in an all-reduce on their GPUs; "c" lets the launch finish.
"$py" - "$workers" <<'EOF'
import os, pty, re, select, subprocess, sys, time

script = f"""
import os, torch, torch.distributed as dist, torchrunx as trx
def stop():
    if dist.get_rank() == dist.get_world_size() - 1:
        value = torch.cuda.current_device()
        breakpoint()
    dist.all_reduce(torch.ones(1, device="cuda"))
    return torch.cuda.current_device()
print("devices", trx.launch(stop, hostnames=["localhost"], workers_per_host={sys.argv[1]}, backend="nccl").ranks)
"""
main, other = pty.openpty()
p = subprocess.Popen([sys.executable, "-c", script], stdin=other, stdout=other, stderr=other)
os.close(other)
seen = ""

def until(pattern, seconds=120):
    global seen
    deadline = time.monotonic() + seconds
    while not re.search(pattern, seen):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{seen[-3000:]}"
        if select.select([main], [], [], 1)[0]:
            try:
                seen += os.read(main, 65536).decode(errors="replace")
            except OSError:  # the launcher ended
                break
    return re.search(pattern, seen)

last = int(sys.argv[1]) - 1
until(rf"\(Pdb rank {last} on localhost\) $")
os.write(main, b"p value, torch.cuda.current_device()\n")
until(rf"\({last}, {last}\)\r?\n\(Pdb rank {last} on localhost\) $")
os.write(main, b"c\n")
until(r"devices \[[\d, ]+\]")
assert p.wait(timeout=60) == 0, seen[-3000:]
print(seen[-1500:])
print("gpu_check: pdb in an NCCL rank opened in the launcher's terminal; c finished the launch")
EOF

if [ "$gpus" -ge 2 ]; then
    "$py" benchmarks/run.py --backend nccl --tools ours torchrun floor --runs 3 \
        --only launch-overhead back-to-back failure-latency
else
    echo "gpu_check: 1 GPU: the NCCL benchmarks need 2 (2 workers per host, one GPU each); skipped"
fi
echo "gpu_check: all checks passed"

# ----------------------------------------------------------------------------------------------
# Training frameworks on GPUs (docs/frameworks.md). CI runs examples/06 to 10 on CPU with gloo;
# here each runs with NCCL, one GPU per worker: every rank must report its own cuda:LOCAL_RANK
# and the launcher must load back what rank 0 saved. For DeepSpeed this is its GPU path (CUDA
# accelerator, ZeRO 2 over NCCL, bf16), which no CPU machine can run. DeepSpeed builds from
# source against the torch above, hence --no-build-isolation.
"$py" -m pip install -q --no-build-isolation -e ".[frameworks]"
fw_gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
fw_workers=$((fw_gpus >= 2 ? 2 : 1))
fw_devices=$("$py" -c "print([f'cuda:{i}' for i in range($fw_workers)])")
fw_out=$(mktemp -d)
for example in 06_transformers 07_accelerate 08_lightning_trainer 09_lightning_fabric 10_deepspeed; do
    flags=(--steps 20 --backend nccl --workers-per-host "$fw_workers" --out-dir "$fw_out/$example")
    [ "$example" = 10_deepspeed ] && flags+=(--bf16)
    out=$("$py" "examples/$example.py" "${flags[@]}") || { echo "$out"; exit 1; }
    echo "$out"
    grep -qxF "devices: $fw_devices" <<<"$out" ||
        { echo "gpu_check: $example: expected devices: $fw_devices" >&2; exit 1; }
    grep -q "^loaded back: eval loss" <<<"$out" ||
        { echo "gpu_check: $example: the checkpoint was not loaded back" >&2; exit 1; }
done
echo "gpu_check: the framework examples passed on $fw_workers GPU(s)"
