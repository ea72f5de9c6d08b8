#!/usr/bin/env bash
# The GPU path, on a machine with NVIDIA GPUs (CI has none): real NCCL DDP launches on this
# host, stall and straggler detection on NCCL, the GPU figures of /health and torchrunx top,
# and the launch benchmarks on NCCL. Needs 2 or more GPUs for the full check; with 1 GPU it
# runs the example on 1 worker, checks that "auto" falls back to gloo for 2 workers, and skips
# the NCCL stall and straggler checks and the benchmarks (each rank needs a GPU of its own).
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

# Stall detection on NCCL (docs/debugging.md, "A launch that hangs"): rank 1 sleeps before an
# all-reduce that rank 0 waits in on its GPU. With stall_timeout=5 the Stalled event must name
# rank 1, the line it sleeps on, and the all-reduce's sequence number, read from NCCL's flight
# recorder (rank 0 read the number from its own recorder just before). Needs a GPU per rank.
# The second argument of each of these three scripts is the device: "cpu" (with gloo) only
# tries a script's own logic on a machine without GPUs.
if [ "$gpus" -ge 2 ]; then
    "$py" - nccl cuda <<'EOF'
import json, sys, tempfile, time
from pathlib import Path

import torchrunx as trx
from torchrunx.errors import StallError
from torchrunx.events import Stalled

backend, kind = sys.argv[1], sys.argv[2]


def hang(folder, kind):
    import torch, torch.distributed as dist
    from torchrunx.worker import stallprobe

    rank = dist.get_rank()
    t = torch.ones(4, device=f"cuda:{torch.cuda.current_device()}" if kind == "cuda" else "cpu")
    for _ in range(3):
        dist.all_reduce(t)
    t.sum().item()  # the three are done on the device
    seq = 1 + max(s for _, s, _ in stallprobe.timings().entries)
    began = {"time": time.time(), "seq": seq, "line": sys._getframe().f_lineno + 2}
    Path(folder, f"began-{rank}").write_text(json.dumps(began))
    if rank == 1: time.sleep(120)  # the sleeping rank (on_stall="fail" ends it)
    dist.all_reduce(t)
    return t.sum().item()  # rank 0 waits here for the all-reduce on its GPU


events = []
with tempfile.TemporaryDirectory() as folder:
    try:
        trx.launch(
            hang, (folder, kind), hostnames=["localhost"], workers_per_host=2, backend=backend,
            stall_timeout=5, on_stall="fail",
            event_handlers=(lambda e: events.append(e) if isinstance(e, Stalled) else None,),
        )
        sys.exit("gpu_check: the launch ended: the NCCL stall was not found")
    except StallError:
        pass
    began = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("began-*"))]
assert len(events) == 1 and len(began) == 2, (events, began)
event, seq, line = events[0], began[0]["seq"], began[1]["line"]
print(event.text)
found = [(w["op"], w["seq"], w["ranks"]) for w in event.diagnosis["waiting"]]
assert found == [("all_reduce", seq, [0])], f"expected rank 0 in all_reduce #{seq}: {found}"
[(where, ranks)] = event.diagnosis["absent"].items()
assert ranks == [1] and where.endswith(f":{line} in hang"), event.diagnosis["absent"]
assert f"all_reduce #{seq} of " in event.text and "rank 1: " in event.text, event.text
took = event.time - max(b["time"] for b in began)
assert took <= 5 + 2, f"the diagnosis came {took:.2f} s after the stall began (target: 7 s)"
print(f"gpu_check: a stall on {backend}: rank 1 named at line {line}, all_reduce #{seq}, "
      f"{took:.2f} s after it began (stall_timeout 5 s)")
EOF

# Stragglers on NCCL (docs/debugging.md, "A rank that is slow"): rank 1's work takes twice
# rank 0's (0.5 s against 0.25 s a step, then an all-reduce on the GPU: with 2 ranks the
# median is their mean, so rank 1 enters 0.125 s after it, past the 0.1 s threshold); the
# StragglerFound event must name rank 1, and only rank 1, within the 40 steps (target: 20).
    "$py" - nccl cuda <<'EOF'
import sys, time

import torchrunx as trx
from torchrunx.events import StragglerFound

backend, kind = sys.argv[1], sys.argv[2]


def steps(count, step, kind):
    import torch, torch.distributed as dist

    rank = dist.get_rank()
    t = torch.ones(4, device=f"cuda:{torch.cuda.current_device()}" if kind == "cuda" else "cpu")
    ended = []
    for _ in range(count):
        time.sleep(2 * step if rank == 1 else step)
        dist.all_reduce(t)
        t.sum().item()
        ended.append(time.time())
    return ended


found = []
result = trx.launch(
    steps, (40, 0.25, kind), hostnames=["localhost"], workers_per_host=2, backend=backend,
    event_handlers=(lambda e: found.append(e) if isinstance(e, StragglerFound) else None,),
)
assert [e.rank for e in found] == [1], f"expected rank 1 named, once: {[e.text for e in found]}"
after = sum(1 for ended in result.rank(0) if ended <= found[0].time)
assert any("rank 1 " in text for text in result.stragglers), result.stragglers
print(f"gpu_check: stragglers on {backend}: {found[0].text}; named after {after} of 40 steps "
      "(target: 20)")
EOF
else
    echo "gpu_check: $gpus GPU: the NCCL stall and straggler checks need 2 (a GPU per rank); skipped"
fi

# torchrunx top's GPU figures (docs/logging.md, "torchrunx top"; docs/health.md): while the
# ranks multiply matrices on their GPUs (one each, backend=None), /health must give every rank a GPU utilisation and
# the GPU memory its process holds (from nvidia-smi, sampled by its agent), and `torchrunx
# top --once` must show the GPU columns. "cpu" checks CPU figures instead.
"$py" - "$workers" cuda <<'EOF'
import json, os, subprocess, sys, tempfile, threading, time, urllib.error, urllib.request

import torchrunx as trx
from torchrunx.events import LaunchStarted

workers, kind = int(sys.argv[1]), sys.argv[2]


def busy(folder, kind):
    import torch

    gpu = int(os.environ["LOCAL_RANK"]) % max(1, torch.cuda.device_count())
    x = torch.rand(2048, 2048, device=f"cuda:{gpu}" if kind == "cuda" else "cpu")
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{folder}/stop") and time.monotonic() < deadline:
        for _ in range(20):
            x = torch.tanh(x @ x)
        x.sum().item()
    return kind


urls, outcome = [], []
folder = tempfile.mkdtemp()
launcher = trx.Launcher(
    hostnames=["localhost"], workers_per_host=workers, backend=None, health_check_port=0,
    event_handlers=(lambda e: urls.append(e.health_url) if isinstance(e, LaunchStarted) else None,),
)
thread = threading.Thread(target=lambda: outcome.append(launcher.run(busy, folder, kind)))
thread.start()
keys = ("gpu_percent", "gpu_memory_bytes") if kind == "cuda" else ("cpu_percent", "rss_bytes")
report, deadline = {}, time.monotonic() + 90
try:
    while True:
        assert thread.is_alive() and time.monotonic() < deadline, (
            f"gpu_check: no {keys} for every rank in /health within 90 s "
            f"(is nvidia-smi on PATH?): {report}")
        if urls:
            try:
                with urllib.request.urlopen(urls[0], timeout=5) as answer:
                    report = json.load(answer)
            except urllib.error.HTTPError as error:
                report = json.load(error)
            ranks = report.get("workers") or []
            if len(ranks) == workers and all(
                w["state"] == "HEALTHY" and w[keys[0]] is not None and w[keys[1]]
                for w in ranks
            ):
                break
        time.sleep(0.5)
    for w in report["workers"]:
        print(f"rank {w['rank']}: {keys[0]} {w[keys[0]]}, {keys[1]} {w[keys[1]]}")
    top = subprocess.run(
        [sys.executable, "-m", "torchrunx", "top", "--once", "--pid", str(os.getpid())],
        capture_output=True, text=True, timeout=60, check=False,
    )
    print(top.stdout)
    assert top.returncode == 0, top.stderr
    heading = next((line for line in top.stdout.splitlines() if line.lstrip().startswith("rank ")), "")
    want = ("gpu%", "gpu mem") if kind == "cuda" else ("cpu%", "rss")
    assert all(column in heading for column in want), f"no {want} columns in: {heading!r}"
finally:
    open(f"{folder}/stop", "w").close()
    thread.join(timeout=120)
assert outcome and outcome[0].ranks == [kind] * workers, outcome
print(f"gpu_check: /health and torchrunx top show every rank's {' and '.join(keys)}")
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
