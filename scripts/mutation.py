#!/usr/bin/env python3
"""Mutation testing of torchrunx's pure core with mutmut, scored module by module.

    python scripts/mutation.py                 # every module, every mutant (see docs/mutation.md)
    python scripts/mutation.py failures env    # some modules only
    python scripts/mutation.py --ci            # CI's subset (below), about 10 minutes
    python scripts/mutation.py --list          # the modules, what is mutated, the guarding tests
    python scripts/mutation.py --separate      # one mutmut session per module (each timed)

The modules are mutated in a copy of the tree in a temporary folder (the source here is never
touched), in one mutmut session (each module would pay about 20 s of set-up on its own; a
module whose tests import torch gets a session of its own, ``Target.own_session``), and
their mutants run only against the pure tests that guard them (``TARGETS``, together; mutmut
runs, of those, the tests that call the mutated function): rule tests on made-up facts, never
a test that starts a process. The copy's ``tests/conftest.py``
gets a guard that fails any test that starts one (fork, spawn, subprocess), so such a test
cannot guard a module here unnoticed: the clean run fails and the module is reported as broken.

A mutant counts as killed when a test fails on it or it runs past its time limit (mutmut's
"killed" and "timeout"; a mutant that timed out is run once more, so that a moment of load on
the machine is not taken for a hang). The score is killed / (mutants checked - known
equivalents), and every module must reach ``TARGET_PERCENT``: the exit status is 1 otherwise.
``EQUIVALENT`` lists the survivors that no test can kill (each with the mutated line, so that
an entry that no longer describes the same mutant is ignored, and the reason).

``--ci``: the modules changed since ``git merge-base HEAD origin/main`` (their source or a
guarding test file; every module if this script changed), or, without such a base or when none
changed, every module; of each, a random sample of its mutants (fixed seed), run in one mutmut
session against their guarding tests together, time-boxed (``--budget``); the target applies
to the sample as a whole.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_PERCENT = 95.0
CI_SEED = 20261126
CI_BUDGET_S = 720.0
CI_SAMPLE = 12
"""Mutants per module in CI's sample (sized so that all modules fit the budget on 2 cores)."""


@dataclass(frozen=True)
class Target:
    """One module: its file, the pure tests that guard it, and what of it is mutated."""

    source: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    """``name`` or ``Class.method`` (``fnmatch`` patterns); empty: every function."""
    note: str = ""
    own_session: bool = False
    """Run in a mutmut session of its own: its tests import torch, and mutmut forks a process
    per mutant, which costs far more from a process that holds torch (the other modules' tests
    never import it)."""


_STATE_TESTS = (
    "tests/test_launch_state.py",
    "tests/test_rules_state.py",
    "tests/test_rules_failures.py",
    "tests/test_rules_more.py",
    "tests/test_warm_state.py",
    "tests/test_rules_runs.py",
    "tests/test_rules_resilience.py",
    "tests/test_rules_parts.py",
)
"""The launch state's rule tests: they guard state.py and its parts (agent_table.py,
attempt.py) alike."""

TARGETS: dict[str, Target] = {
    "failures": Target(
        "torchrunx/launcher/state/failures.py",
        (
            "tests/test_rules_failures.py",
            "tests/test_launch_state.py",
            "tests/test_rules_more.py",
            "tests/test_rules_runs.py",
        ),
    ),
    "launch_state": Target(
        "torchrunx/launcher/state/state.py",
        _STATE_TESTS,
        note="runs, stops, restarts, phases and read-outs",
    ),
    "agent_table": Target(
        "torchrunx/launcher/state/agent_table.py",
        _STATE_TESTS,
        note="every agent and the world: moves, hellos, exits, silences, the world's changes",
    ),
    "attempt": Target(
        "torchrunx/launcher/state/attempt.py",
        _STATE_TESTS,
        note="the ranks and faults of an attempt: moves, hellos, exits, outcomes",
    ),
    "kubernetes": Target(
        "torchrunx/engines/kubernetes.py",
        ("tests/test_rules_engines.py",),
        functions=(
            "parse_options",
            "split_provider_argument",
            "KubectlOptions.*",
            "read_pods",
            "_pod",
            "_order",
            "_number",
            "Pod.*",
            "KubernetesProvider.transport",
        ),
        note="kubectl's options, command lines and pods (kubectl itself runs in test_kubernetes)",
    ),
    "relay_frames": Target(
        "torchrunx/wire/relay.py",
        ("tests/test_rules_relay.py",),
        functions=("frame", "FrameSplitter.*", "ByteQueue.*"),
        note="the relay's frames: cut from a stream, queued and written in pieces",
    ),
    "ray_nodes": Target(
        "torchrunx/engines/ray.py",
        ("tests/test_rules_engines.py",),
        functions=(
            "node_table",
            "_can_work",
            "_hostname",
            "ordered",
            "ray_address",
            "RayProvider.transport",
        ),
        note="which Ray nodes are hosts, in which order (Ray itself runs in test_ray)",
    ),
    "spares": Target(
        "torchrunx/launcher/state/spares.py",
        ("tests/test_rules_resilience.py",),
        note="spare_hosts and min_hosts: their checks and the next world",
    ),
    "preempt": Target(
        "torchrunx/launcher/launch/preempt.py",
        ("tests/test_rules_resilience.py",),
        functions=("slurm_kill_wait", "default_grace", "end_preemption", "requeue_job"),
        note=(
            "the default grace, the end of a preemption and the requeue (scontrol answered "
            "without a process; not the SIGTERM handler)"
        ),
    ),
    "plan": Target(
        "torchrunx/launcher/settings/plan.py",
        ("tests/test_rules_plan.py", "tests/test_rules_engines.py", "tests/test_rules_relay.py"),
        functions=("check_agent_start", "check_relay", "paired_transport", "start_methods"),
        note="agent_start and relay checked, each host's transport (the machine's facts given)",
    ),
    "hangs": Target(
        "torchrunx/launcher/state/hangs.py",
        ("tests/test_rules_hangs.py",),
        note="a stalled launch's diagnosis from the ranks' snapshots, and the stragglers",
    ),
    "stragglers": Target(
        "torchrunx/launcher/launch/stragglers.py",
        ("tests/test_rules_stragglers.py",),
        functions=("check_straggler_threshold", "entries_of", "TimingsRound.*", "StragglerWatch.*"),
        note="the watch: when it asks, what it compares, whom it names (not the launch's part)",
    ),
    "memory": Target(
        "torchrunx/agent/memory.py",
        ("tests/test_oom.py", "tests/test_rules_memory.py"),
        functions=(
            "oom_kill_count",
            "memory_cgroup",
            "cgroup_mounts",
            "_number",
            "_size",
            "sigkill_cause",
        ),
        note="a SIGKILL's cause from the kernel's counts (the files' texts; not their reading)",
    ),
    "cli_hints": Target(
        "torchrunx/cli_hints.py",
        ("tests/test_rules_cli.py",),
        note="torchrun's options and earlier releases' refused, with what to write instead",
    ),
    "cli_typed": Target(
        "torchrunx/cli_options.py",
        ("tests/test_rules_cli.py",),
        functions=("typed_arguments", "_annotations"),
        note="a function's arguments read as its annotations say",
    ),
    "lines": Target(
        "torchrunx/wire/lines.py",
        ("tests/test_rules_lines.py",),
        note="marked lines, a stream cut into whole lines, a line cut to its bytes",
    ),
    "renamed": Target(
        "torchrunx/launcher/settings/renamed.py",
        ("tests/test_rules_cli.py", "tests/test_compat.py"),
        note="keywords of earlier releases refused with what replaces them",
    ),
    "results": Target(
        "torchrunx/launcher/state/results.py",
        ("tests/test_rules_results.py",),
        functions=("LaunchResult.rank", "LaunchResult.index"),
        note="a launch's values by rank or by host (the properties are read by these)",
    ),
    "peercred": Target(
        "torchrunx/peercred.py",
        ("tests/test_security_debugger.py",),
        functions=("find_peer", "proc_address"),
        note="a loopback connection's peer in /proc/net/tcp (the reading of the machine aside)",
    ),
    "inbox": Target(
        "torchrunx/launcher/launch/inbox.py",
        (
            "tests/test_rules_more.py",
            "tests/test_rules_runs.py",
        ),
        note="driven with stand-in peers, pool and listener: no socket, no process",
    ),
    "handshake": Target(
        "torchrunx/wire/handshake.py",
        (
            "tests/test_rules_handshake.py",
            "tests/test_pure.py",
            "tests/test_security.py",
            "tests/test_rules_more.py",
        ),
        functions=(
            "new_secret",
            "_mac",
            "_recv_exact",
            "server_greeting",
            "session_keys",
            "check_client_reply",
            "client_reply",
            "client_handshake",
            "connect",
        ),
        note="the handshake, the session keys and connect's retries",
    ),
    "records": Target(
        "torchrunx/wire/records.py",
        (
            "tests/test_rules_handshake.py",
            "tests/test_pure.py",
            "tests/test_security.py",
            "tests/test_rules_more.py",
        ),
        functions=(
            "encode_frame_start",
            "take_plaintext",
            "frame_pieces",
            "Sealer.*",
            "Connection.*",
            "FrameParser.*",
            "FrameReader.*",
            "_recv_exact_into",
        ),
        note="sealed records and frames",
    ),
    "messages": Target(
        "torchrunx/wire/messages.py",
        (
            "tests/test_rules_handshake.py",
            "tests/test_pure.py",
            "tests/test_security.py",
            "tests/test_rules_more.py",
        ),
        functions=("_load_message",),
        note="the check of a frame's header; not the message classes",
    ),
    "env": Target(
        "torchrunx/env.py",
        (
            "tests/test_rules_env.py",
            "tests/test_pure.py",
            "tests/test_compat.py",
            "tests/test_rules_more.py",
        ),
    ),
    "hostlists": Target(
        "torchrunx/hosts/hostlists.py",
        (
            "tests/test_hosts.py",
            "tests/test_slurm.py",
            "tests/test_plugins.py",
            "tests/test_rules_more.py",
        ),
    ),
    "hosts": Target(
        "torchrunx/launcher/settings/resolve.py",
        ("tests/test_hosts.py", "tests/test_plugins.py", "tests/test_rules_more.py"),
        functions=(
            "hostnames_source",
            "check_hostname",
            "check_hostnames",
            "check_workers",
            "_check_lengths",
        ),
        note="the validation of hostnames and workers_per_host (resolution and counting read "
        "the machine)",
    ),
    "launcher": Target(
        "torchrunx/launcher/launcher.py",
        (
            "tests/test_api.py",
            "tests/test_compat.py",
            "tests/test_hosts.py",
            "tests/test_rules_more.py",
            "tests/test_rules_hangs.py",
        ),
        functions=("Launcher.validate", "_validate_*"),
        note="the checks of the Launcher's fields",
    ),
    "devices": Target(
        "torchrunx/devices.py",
        ("tests/test_hosts.py", "tests/test_gpu.py", "tests/test_rules_more.py"),
        functions=("device_env", "cuda_device", "resolve_backend", "process_group_options"),
        note="not the probes of the machine (count_local_gpus, count_local_cpus)",
        own_session=True,  # tests/test_gpu.py imports torch
    ),
    "logs": Target(
        "torchrunx/logs.py",
        ("tests/test_rules_logs.py",),
        functions=(
            "check_log_fields",
            "_may_have_defaults",
            "is_handler_list",
            "call_handler_factory",
            "_takes_an_argument",
            "SourceFilter.*",
        ),
        note="the checks of log_handlers and console_ranks, a handler function's call",
    ),
    "preflight": Target(
        "torchrunx/launcher/preflight.py",
        ("tests/test_rules_check.py",),
        functions=("judge", "_no_report", "_compare", "format_checks", "HostCheck.*"),
        note="torchrunx check's judgement of each host's answer, and its lines",
    ),
    "reports": Target(
        "torchrunx/launcher/state/reports.py",
        ("tests/test_rules_reports.py",),
        functions=("stacks_note", "_same_stack", "innermost_frame", "rank_ranges"),
        note="the stacks note: ranks with the same stack together",
    ),
    "where": Target(
        "torchrunx/launcher/view/where.py",
        ("tests/test_rules_reports.py",),
        functions=("StacksLook.*",),
        note="a look at every rank's stacks (Ctrl-\\): who answered, when to print, what",
    ),
    "debugger": Target(
        "torchrunx/launcher/view/debugger.py",
        ("tests/test_rules_debugger.py",),
        functions=("Debugger.*",),
        note="pdb in a rank, the launcher's side: who has the terminal, what is sent, pauses",
    ),
    "probe": Target(
        "torchrunx/agent/probe.py",
        ("tests/test_rules_check.py",),
        functions=("ProbeRequest.*", "ProbeReport.*"),
        note="the lines between torchrunx check and its probes",
    ),
    "ship": Target(
        "torchrunx/engines/ship.py",
        ("tests/test_rules_reach.py",),
        functions=(
            "make_bundle",
            "_within",
            "lib_entry",
            "Bundle.place",
            "_Ignores.*",
            "_walk",
        ),
        note="the bundle: what is shipped, where it goes, containment and ignore rules",
    ),
    "channel": Target(
        "torchrunx/wire/channel.py",
        ("tests/test_rules_channel.py",),
        functions=("ChannelReader.*", "ChannelConnection.*"),
        note="a worker's channel: its frames, where a stream may end (socket pairs)",
    ),
    "environ": Target(
        "torchrunx/launcher/settings/environ.py",
        ("tests/test_rules_environ.py", "tests/test_rules_plan.py", "tests/test_rules_debugger.py"),
        note="the launcher's environment variables, read once from a given mapping and checked",
    ),
    "limits": Target(
        "torchrunx/launcher/launch/limits.py",
        ("tests/test_limits.py",),
        functions=("descriptors_needed",),
        note="what a launch may need of the open-file limit (not DescriptorLimit: it sets it)",
    ),
    "errors": Target(
        "torchrunx/errors.py",
        ("tests/test_rules_errors.py", "tests/test_rules_failures.py"),
        note="the errors' messages, pickling (__reduce__) and notes",
    ),
}

IMPURE = (
    # Tests of the guarding files above that start processes (the guard finds them): left out.
    "tests/test_rules_more.py::test_rule_what_slurm_cannot_give_is_a_slurm_error_and_still_a_runtime_error",
    "tests/test_limits.py::test_the_limit_is_raised_held_by_each_launch_and_put_back_by_the_last",
    "tests/test_limits.py::test_a_hard_limit_below_the_need_is_reached_and_said_with_the_fix",
    "tests/test_limits.py::test_a_launch_on_more_hosts_than_the_soft_limit_allows_runs_and_puts_it_back",
    "tests/test_pure.py::test_agent_script_keeps_hostile_values_intact",
    "tests/test_pure.py::test_tensors_travel_without_numpy_and_without_a_copy",
    "tests/test_hosts.py::test_slurm_allocation_from_the_environment",
    "tests/test_hosts.py::test_resolve_hosts_inside_an_allocation",
    "tests/test_hosts.py::test_count_local_gpus_with_nvidia_smi",
    "tests/test_hosts.py::test_a_failing_nvidia_smi_counts_no_gpu",
    "tests/test_hosts.py::test_a_host_name_with_shell_syntax_never_reaches_a_shell",
    "tests/test_compat.py::test_launch_like_0_4_log_folder_events_beside_it_and_local_environment",
    "tests/test_compat.py::test_gpu_and_cpu_launches",
    "tests/test_compat.py::test_a_0_4_call_with_only_workers_and_backend_given",
    "tests/test_hosts.py::test_the_plan_keeps_what_hostnames_named_classified_once",
    "tests/test_plugins.py::test_imports_go_one_way",
    "tests/test_plugins.py::test_plugin_package_registers_each_group",
    "tests/test_plugins.py::test_run_needs_the_arguments_after_the_separator",
    "tests/test_plugins.py::test_a_preset_does_not_give_a_script_a_process_group",
    "tests/test_gpu.py::test_dry_run_counts_this_machines_gpus",
    "tests/test_gpu.py::test_dry_run_says_nothing_of_cores_where_auto_counts_gpus",
    "tests/test_gpu.py::test_dry_run_of_remote_hosts_states_the_rule",
    "tests/test_gpu.py::test_agents_report_gpus_and_auto_is_gloo_when_a_worker_has_none",
    "tests/test_gpu.py::test_auto_is_nccl_for_every_worker_when_each_has_a_gpu",
    "tests/test_gpu.py::test_isolate_gpus_is_an_opt_in",
    "tests/test_gpu.py::test_command_gives_a_function_every_gpu_too",
    "tests/test_api.py::test_agent_side_does_not_import_the_launcher",
    "tests/test_api.py::test_the_agents_import_stays_lean",
    "tests/test_api.py::test_the_lean_guard_sees_a_heavy_import",
    "tests/test_api.py::test_import_torchrunx_loads_no_launcher_until_a_name_is_used",
    "tests/test_oom.py::test_a_worker_killed_by_someone_lists_the_usual_causes",
    "tests/test_oom.py::test_a_worker_the_oom_killer_ends_is_said_to_be_oom_killed",
    "tests/test_security_debugger.py::test_another_users_connection_is_seen_as_theirs",
    (
        "tests/test_security_debugger.py::"
        "test_on_this_machine_another_user_cannot_attach_to_the_chosen_rank"
    ),
)

SOURCE_READERS = (
    # Tests of the guarding files that read torchrunx's source text: mutmut's copy of a module
    # holds its trampolines and mutants (each with the original's calls), not that text.
    "tests/test_rules_plan.py::test_rule_nothing_under_the_launcher_reads_os_environ_but_the_plan",
)

_ORDER = "only ordering matters: 'collective', the one kind not in _RANK, sorts last either way"
_RSPLIT = "the part after the last separator is the same whatever the number of splits"
_FALSY = "None is as false as False, and the value is only ever tested for truth"
_PERF = "how many bytes one recv call asks for: a performance choice, the bytes are the same"
_GROWTH = "how much a part's buffer grows at a time: memory only, capped at the declared size"
_PICKLE = "the receiver unpickles any pickle protocol; the message is the same"
_UNREAD = "its first value is never read: it is set again before any use"
_ONE = "joins a list that holds at most one string: the separator never appears"
_ZIP = "the two sequences always have the same length"
_WIDTH = "zfill to the width of a number without a leading zero changes no number in its range"
_SPLIT = "everything before the first '#' is the same whatever the number of splits"
_SHRINK = "when an idle reader's buffer is swapped for a small one: memory only, same bytes"
_UNREACHABLE = (
    "the message of a defensive catch: the frame parser raises only ProtocolError today, so "
    "no stream reaches it"
)
_ALNUM = "a character replaced by 'XXXX' is as alphanumeric as one removed"

_DIGEST_NAME = "OpenSSL takes a digest's name in either case"
_SHORTCUT = (
    "only more chunks take the general way (split, redraws) instead of the shortcut for plain "
    "lines: the same lines come out"
)
_CUT_SHORTCUT = (
    "a text that surely fits is measured in bytes instead of returned at once: it fits either way"
)
_TYRO = (
    "tyro's output goes to stderr, which is redirected into a buffer that is dropped: "
    "whether tyro prints there is never seen (a test asserts that nothing is printed)"
)
_LAST_LINE = "the last piece of an rsplit is the same whatever the number of splits"
_ONLY_0 = (
    "the variable's default is only compared with '0': None, no default or another text than "
    "'0' compare the same"
)
_PROGRESS = (
    "the table has only the keys '1' and '0': an unset variable read as None, '' or 'XXXX' "
    "finds no key either way (None)"
)
EQUIVALENT: dict[str, tuple[str, str]] = {
    "torchrunx.launcher.state.failures.x_check_restarts__mutmut_25": (
        'entry.replace(".", "").replace("_", "XXXX").isalnum()',
        "an underscore dropped or made letters: isalnum() says the same either way",
    ),
    "torchrunx.agent.probe.xǁProbeRequestǁfrom_json__mutmut_59": (
        'keep_path=bool(raw.get("keep_path", None)),',
        "bool(None) is False, the default it replaces",
    ),
    "torchrunx.launcher.launch.inbox.xǁInboxǁquarantine__mutmut_13": (
        "-                STOP_GRACE,",
        "Stop's grace_period defaults to 3.0, which STOP_GRACE is",
    ),
    "torchrunx.launcher.launch.inbox.xǁInboxǁquarantine__mutmut_15": (
        "-                restart=False,",
        "Stop's restart defaults to False",
    ),
    "torchrunx.launcher.launch.inbox.xǁInboxǁquarantine__mutmut_25": (
        "self.emit(self.state.current.agent_failed(agent, None, None))",
        "with no error, agent_failed records no fault: its time is never read",
    ),
    "torchrunx.launcher.launch.inbox.xǁInboxǁquarantine__mutmut_33": (
        "logger.warning(line)",
        "the line holds host names and numbers: no % in it for logging to expand",
    ),
    "torchrunx.launcher.launch.preempt.x_default_grace__mutmut_2": (
        "env = os.environ if (environ is None) and False else environ",
        "None is passed on, and in_slurm_allocation(None) reads os.environ itself",
    ),
    "torchrunx.wire.handshake.x__mac__mutmut_10": (
        'return hmac.digest(secret, b"|".join(parts), "SHA256")',
        _DIGEST_NAME,
    ),
    "torchrunx.wire.handshake.x_session_keys__mutmut_10": (
        'prk = hmac.digest(server_nonce + client_nonce, secret, "SHA256")',
        _DIGEST_NAME,
    ),
    "torchrunx.wire.handshake.x_session_keys__mutmut_24": (
        'return hmac.digest(prk, info + b"\\x01", "SHA256")[:KEY_BYTES]',
        _DIGEST_NAME,
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁ__init____mutmut_14": (
        "self._reading = None",
        "read only as a truth value, where None and False are alike",
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁ_answer__mutmut_4": (
        "stop.waiting = None",
        "read only as a truth value, where None and False are alike",
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁon_output__mutmut_22": (
        'stop.prompt = message.text.rsplit("\\n", )[-1]',
        _LAST_LINE,
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁon_output__mutmut_25": (
        'stop.prompt = message.text.rsplit("\\n", 2)[-1]',
        _LAST_LINE,
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁ_current__mutmut_1": (
        "return None if (self.current is None) and False else self.stops.get(self.current)",
        "stops has no None key: get(None) is None too",
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁ_on_readable__mutmut_7": (
        "data = None",
        "read only as a truth value (the end of input), where None and b'' are alike",
    ),
    "torchrunx.launcher.view.debugger.xǁDebuggerǁ_on_readable__mutmut_6": (
        "data = os.read(self._fd, 65537)",
        "a terminal's line is far shorter than either size; lines are joined across reads",
    ),
    "torchrunx.launcher.state.reports.x__same_stack__mutmut_16": (
        'lines.append(line.rpartition(" 0x")[0])  # "Current thread" or "Thread"',
        "a thread's header holds ' 0x' once (its id): the first occurrence is the last",
    ),
    "torchrunx.launcher.state.reports.x_innermost_frame__mutmut_3": (
        '_, current, after = text.rpartition("Current thread")',
        "faulthandler writes 'Current thread' once: the first occurrence is the last",
    ),
    "torchrunx.engines.ship.x_make_bundle__mutmut_74": (
        'separators=(",", "XX:XX")',
        "the manifest is a list of lists: JSON's key separator never appears in it",
    ),
    "torchrunx.engines.ship.x\u01c1_Ignores\u01c1read__mutmut_11": (
        'decode("UTF-8", "replace")',
        "Python takes a codec's name in either case",
    ),
    "torchrunx.engines.ship.x__walk__mutmut_43": ("ignored(rel, folder=None)", _FALSY),
    "torchrunx.engines.ship.x_make_bundle__mutmut_51": (
        "if (rel) or True else place",
        "a shipped file's rel is empty: normpath(join(place, '')) is place itself",
    ),
    "torchrunx.wire.channel.x\u01c1ChannelReader\u01c1read__mutmut_8": (
        "if wanted > _DIRECT_BYTES:",
        (
            "a part missing exactly 64 KiB is read through the scratch buffer instead of "
            "straight into it: a copy more, the same bytes"
        ),
    ),
    "torchrunx.wire.channel.x\u01c1ChannelConnection\u01c1send__mutmut_9": (
        'view.cast("b")',
        "signed or unsigned bytes, sendall sends the same bytes",
    ),
    "torchrunx.launcher.settings.plan.x_start_methods__mutmut_27": (
        "local, strict=None) if not",
        _ZIP,
    ),
    "torchrunx.launcher.settings.plan.x_start_methods__mutmut_30": (
        "zip(hostnames, local, ) if",
        _ZIP,
    ),
    "torchrunx.launcher.settings.plan.x_start_methods__mutmut_31": (
        "local, strict=False) if not",
        _ZIP,
    ),
    "torchrunx.agent.memory.x_memory_cgroup__mutmut_11": (
        '[*line.split(":", 2), "", "XXXX"][:3]',
        (
            "the second pad is the path only of a line without a colon, whose controllers are "
            "empty and which does not start with '0::': its path is never read"
        ),
    ),
    "torchrunx.agent.memory.x_cgroup_mounts__mutmut_25": (
        'after[2] if len(after) > 2 else "XXXX"',
        "options of a line that has none: 'XXXX' names no memory controller, as '' does not",
    ),
    "torchrunx.cli_hints.x\u01c1_TorchrunOption\u01c1__init____mutmut_2": (
        "super().__init__(**kwargs)",
        "argparse makes an action with keyword arguments only: args is always empty",
    ),
    "torchrunx.cli_hints.x_add_renamed_options__mutmut_13": (
        'nargs="*", dest=None, help',
        "argparse derives the same dest from the option (--worker-timeout: worker_timeout)",
    ),
    "torchrunx.cli_hints.x_add_renamed_options__mutmut_18": (
        'action=_Renamed, nargs="*", help=argparse.SUPPRESS)',
        "argparse derives the same dest from the option (--worker-timeout: worker_timeout)",
    ),
    "torchrunx.cli_options.x_typed_arguments__mutmut_36": ("console_outputs=None)", _TYRO),
    "torchrunx.cli_options.x_typed_arguments__mutmut_39": ('args=["--", word], )', _TYRO),
    "torchrunx.cli_options.x_typed_arguments__mutmut_41": ("console_outputs=True)", _TYRO),
    "torchrunx.launcher.state.hangs.x_chance_of_being_last__mutmut_21": (
        "for k in range(times, of + 2))",
        "math.comb(of, of + 1) is 0: the extra term adds nothing",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_18": (
        "self.since_ns = 1",
        "no collective was entered in the first nanosecond of 1970: 0 and 1 exclude the same",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_6": (
        'self.attempt: int | None = ""',
        "no attempt runs before the first run_state, which sets it (any value but a number)",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_7": (
        "self.running = None",
        "read only as a truth value: None is false too",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_9": (
        "self.next_ask = None",
        "read only while an attempt runs, and the first run_state sets it",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_10": (
        "self.next_ask = 1.0",
        "read only while an attempt runs, and the first run_state sets it",
    ),
    "torchrunx.launcher.launch.stragglers.x\u01c1StragglerWatch\u01c1__init____mutmut_11": (
        'self.round: TimingsRound | None = ""',
        "the first run_state (a new attempt) sets it to None before anything reads it",
    ),
    "torchrunx.launcher.state.hangs.x_entry_from_recorder__mutmut_6": (
        'or ("XXXX", "")',
        "the default pair's second name is the one read (a pair has two): the first never is",
    ),
    "torchrunx.wire.lines.x\u01c1LineSplitter\u01c1feed__mutmut_11": (
        "inner = data.count(_RECORD_START) + data.count(",
        _SHORTCUT,
    ),
    "torchrunx.wire.lines.x\u01c1LineSplitter\u01c1feed__mutmut_15": (
        'data.count(b"XX\\nXX"',
        _SHORTCUT,
    ),
    "torchrunx.wire.lines.x\u01c1LineSplitter\u01c1feed__mutmut_19": (
        "inner < data.startswith(_RECORD_START)",
        _SHORTCUT,
    ),
    "torchrunx.wire.lines.x__redraws__mutmut_5": (
        "if start >= 0:",
        "a record at the start: nothing before it, and the record alone, as the next branch gives",
    ),
    "torchrunx.wire.lines.x_cut_line__mutmut_2": ("len(text) * 5 <= limit", _CUT_SHORTCUT),
    "torchrunx.wire.lines.x_cut_line__mutmut_3": ("len(text) * 4 < limit", _CUT_SHORTCUT),
    "torchrunx.wire.relay.x\u01c1FrameSplitter\u01c1_take__mutmut_5": (
        "if len(head) < left:",
        (
            "a chunk exactly as long as what is left is cut to itself and an empty rest, which "
            "the next take drops: the same bytes"
        ),
    ),
    "torchrunx.wire.relay.x\u01c1FrameSplitter\u01c1_take__mutmut_12": (
        "left = None",
        "None ends the loop as 0 does: it is only tested for truth after",
    ),
    "torchrunx.wire.relay.x\u01c1FrameSplitter\u01c1_take__mutmut_16": (
        "(len(parts) == 1) and False",
        "one part joined is the same bytes as the part itself",
    ),
    "torchrunx.wire.relay.x\u01c1ByteQueue\u01c1write_to__mutmut_17": (
        "written = None",
        "None ends the loop as 0 does: it is only tested for truth after",
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_46": (
        'env.get("TORCHRUNX_HINTS", None) == "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_48": (
        'env.get("TORCHRUNX_HINTS", ) == "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_51": (
        'env.get("TORCHRUNX_HINTS", "XX1XX") == "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_61": (
        'get(env.get("TORCHRUNX_PROGRESS", None))',
        _PROGRESS,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_63": (
        'get(env.get("TORCHRUNX_PROGRESS", ))',
        _PROGRESS,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_66": (
        'get(env.get("TORCHRUNX_PROGRESS", "XXXX"))',
        _PROGRESS,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_68": (
        'env.get("TORCHRUNX_VIEW", None) != "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_70": (
        'env.get("TORCHRUNX_VIEW", ) != "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_read_environ__mutmut_73": (
        'env.get("TORCHRUNX_VIEW", "XX1XX") != "0"',
        _ONLY_0,
    ),
    "torchrunx.launcher.settings.environ.x_log_level_from_env__mutmut_7": (
        'environ.get(LOG_LEVEL_ENV_VAR, "info").strip()',
        "the name is upper-cased before it is looked up: 'info' is 'INFO'",
    ),
    # mutant name: (its mutated line, why no test can tell it from the original). An entry
    # whose line is no longer the mutant's (the code changed) is ignored: the mutant counts.
    "torchrunx.launcher.state.failures.x__order__mutmut_5": (
        "_RANK.get(fault.kind, 3)",
        _ORDER,
    ),
    "torchrunx.launcher.state.failures.x_restarts_for__mutmut_12": (
        'type_name.rsplit(".", )[-1]',
        _RSPLIT,
    ),
    "torchrunx.launcher.state.failures.x_restarts_for__mutmut_15": (
        'type_name.rsplit(".", 2)[-1]',
        _RSPLIT,
    ),
    "torchrunx.devices.x_resolve_backend__mutmut_4": ("undecided = None", _FALSY),
    "torchrunx.launcher.state.agent_table.x\u01c1AgentTable\u01c1workers_ended__mutmut_4": (
        "message.attempt <= attempt",
        "for an equal attempt the reply is accepted by the first condition already",
    ),
    "torchrunx.launcher.state.attempt.x\u01c1AttemptState\u01c1settle__mutmut_2": (
        "self._waiting.discard(None)",
        "a cache of due/next_due: a settled rank's settle_by is None, so it is never due",
    ),
    "torchrunx.launcher.state.attempt.x\u01c1AttemptState\u01c1settle__mutmut_3": (
        "self._alarmed.discard(None)",
        "a cache of alarm, which skips settled ranks",
    ),
    "torchrunx.launcher.state.state.x\u01c1LaunchState\u01c1timings__mutmut_38": (
        "ranks, strict=None)",
        _ZIP,
    ),
    "torchrunx.launcher.state.state.x\u01c1LaunchState\u01c1timings__mutmut_41": (
        "zip(self.ranks, ranks, )",
        _ZIP,
    ),
    "torchrunx.launcher.state.state.x\u01c1LaunchState\u01c1timings__mutmut_42": (
        "ranks, strict=False)",
        _ZIP,
    ),
    "torchrunx.launcher.launch.inbox.x\u01c1Inbox\u01c1drop__mutmut_2": (
        "(conn is None) and False",
        "peers has no None key: peers.get(None) is None too",
    ),
    "torchrunx.wire.handshake.x_client_reply__mutmut_47": ("role_byte, server=None)", _FALSY),
    "torchrunx.wire.records.x_encode_frame_start__mutmut_3": ("protocol=None)", _PICKLE),
    "torchrunx.wire.records.x_encode_frame_start__mutmut_5": ("pickle.dumps(message, )", _PICKLE),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1_room__mutmut_4": (
        "len(part) <= need",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1_room__mutmut_15": ("3 * len(part)", _GROWTH),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1_cut__mutmut_50": (
        "self._finish(None)",
        (
            "a frame begun there still has bytes to come (a whole one is cut before): _finish "
            "only passes its leading empty parts and appends no frame"
        ),
    ),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1target__mutmut_4": (
        "self._filled <= size:",
        (
            "a record that exactly fills the rest of a part is decrypted and copied instead of "
            "decrypted in place: the same bytes"
        ),
    ),
    "torchrunx.wire.records.x\u01c1Connection\u01c1__init____mutmut_8": (
        "_close_sent = None",
        _FALSY,
    ),
    "torchrunx.wire.records.x\u01c1Connection\u01c1close__mutmut_1": (
        "fileno() > 0:",
        "a connection's socket is never descriptor 0 (standard input)",
    ),
    "torchrunx.wire.records.x\u01c1Connection\u01c1close__mutmut_2": (
        "fileno() >= 1:",
        "a connection's socket is never descriptor 0 (standard input)",
    ),
    "torchrunx.wire.records.x__recv_exact_into__mutmut_5": ("is None) and False else 0", _PERF),
    "torchrunx.wire.records.x__recv_exact_into__mutmut_6": ("is None) or True else 0", _PERF),
    "torchrunx.wire.records.x__recv_exact_into__mutmut_7": ("gettimeout() is not None", _PERF),
    "torchrunx.wire.records.x__recv_exact_into__mutmut_16": ("size - received, )", _PERF),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1__init____mutmut_3": (
        "_sizes: list[int] = None",
        _UNREAD,
    ),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1__init____mutmut_4": (
        "_parts: list[bytearray] = None",
        _UNREAD,
    ),
    "torchrunx.wire.records.x\u01c1FrameParser\u01c1feed__mutmut_10": (
        "if position <= len(view):",
        "with nothing left, an empty rest is appended and the buffer cut again: no change",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1read__mutmut_4": (
        "while received <= budget:",
        "one more read when exactly the budget was read: the budget is a bound, not an amount",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1read_record__mutmut_12": (
        "self._record_size(None)",
        "view[None:] is view[0:]",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1read_record__mutmut_14": (
        "len(self._raw) <= _RECORD.size + size",
        "growing a buffer that is just large enough by zero bytes",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1read_record__mutmut_19": (
        "size + len(self._raw))",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_open__mutmut_31": (
        "target = None",
        "every part decrypted, then copied, instead of decrypted in place: the same bytes",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_open_all__mutmut_5": (
        "self._have - start > _RECORD.size:",
        "a lone record header cannot be opened either way: it waits for the rest of its record",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_3": (
        "_RECORD.size - self",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_4": (
        "_record_size(None)",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_15": (
        "2 / len(self._raw)",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_16": (
        "3 * len(self._raw)",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_17": (
        "size - _MAX_RECORD",
        _GROWTH,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_make_room__mutmut_21": (
        "bytes(grown + len(self._raw))",
        _GROWTH + " (this one past one record's room: a memory bound no test asserts)",
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_release_if_idle__mutmut_1": (
        "IDLE_BUFFER_BYTES or self._have",
        _SHRINK,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_release_if_idle__mutmut_2": (
        "len(self._raw) >= IDLE_BUFFER_BYTES",
        _SHRINK,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_release_if_idle__mutmut_3": (
        "self._have < IDLE_BUFFER_BYTES",
        _SHRINK,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_open__mutmut_61": (
        "            None",
        _UNREACHABLE,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_open__mutmut_62": (
        "type(None).__name__",
        _UNREACHABLE,
    ),
    "torchrunx.wire.records.x\u01c1FrameReader\u01c1_open__mutmut_63": (
        "exception_text(None)",
        _UNREACHABLE,
    ),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_15": (
        "break",
        "an empty match comes only at the end of the group: continue and break both end the loop",
    ),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_24": ('["XXXX".join(literals)]', _ONE),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_27": ('"XXXX".join(literals[len(', _ONE),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_48": ("values, strict=None))", _ZIP),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_51": ("zip(order, values, ))", _ZIP),
    "torchrunx.hosts.hostlists.x__expand_group__mutmut_52": ("values, strict=False))", _ZIP),
    "torchrunx.hosts.hostlists.x__expand_ranges__mutmut_26": ('startswith("0")) or True', _WIDTH),
    "torchrunx.hosts.hostlists.x__expand_ranges__mutmut_29": ('startswith("0") else 1', _WIDTH),
    "torchrunx.hosts.hostlists.x__slurm_gpus__mutmut_17": ('item.rsplit(":", )[-1]', _RSPLIT),
    "torchrunx.hosts.hostlists.x__slurm_gpus__mutmut_20": ('item.rsplit(":", 2)[-1]', _RSPLIT),
    "torchrunx.launcher.launcher.x__validate_restarts__mutmut_23": ('replace(".", "XXXX")', _ALNUM),
    "torchrunx.launcher.launcher.x__validate_restarts__mutmut_25": ('replace("_", "XXXX")', _ALNUM),
    "torchrunx.env.x_check_env_fields__mutmut_10": (
        "break",
        "copy_env_vars, the entry skipped, is the loop's last: continue and break both end it",
    ),
    "torchrunx.hosts.hostlists.x_parse_hostfile__mutmut_13": ('raw.split("#", )[0]', _SPLIT),
    "torchrunx.hosts.hostlists.x_parse_hostfile__mutmut_16": ('raw.split("#", 2)[0]', _SPLIT),
}

GUARD = '''

# --- added by scripts/mutation.py in its copy of the tree: no test here starts a process ---
import os as _mutation_os
import subprocess as _mutation_subprocess

import pytest as _mutation_pytest


class ProcessStartedError(BaseException):
    """A test that guards a module in scripts/mutation.py started a process."""


def _mutation_refuse(*_args, **_kwargs):
    raise ProcessStartedError("a pure test started a process: list it in IMPURE")


@_mutation_pytest.fixture(autouse=True)
def _mutation_no_processes(monkeypatch):
    monkeypatch.setattr(_mutation_subprocess.Popen, "_execute_child", _mutation_refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        monkeypatch.setattr(_mutation_os, name, _mutation_refuse)


def pytest_collection_modifyitems(config, items):
    """Tests that need the namespace or SLURM test hosts never run here."""
    hosts = {"cluster", "slurm", "isolated", "isolated_module"}
    keep = [i for i in items if not hosts & set(getattr(i, "fixturenames", ()))]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
'''

MUTMUT = "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; sys.exit(cli())"
LIST_MUTANTS = """
import json, sys
from mutmut.mutation.file_mutation import mutate_file_contents
names = {}
for path in dict.fromkeys(sys.argv[1:]):
    with open(path) as f:
        names[path] = mutate_file_contents(path, f.read()).mutant_names
print(json.dumps(names))
"""
READ_RESULTS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
try:
    codes = json.load(open(sys.argv[1]))["exit_code_by_key"]
except (OSError, ValueError, KeyError) as exc:  # cut short while mutmut wrote it
    print(f"unreadable {sys.argv[1]}: {exc!r}", file=sys.stderr)
    codes = {}
out = {}
for name in json.load(sys.stdin):
    status = status_by_exit_code[codes.get(name)]
    seen = status in ("killed", "timeout", "segfault", "caught by type check", "not checked")
    try:
        out[name] = [status, None if seen else get_diff_for_mutant(name)]
    except Exception as exc:  # noqa: BLE001 (one mutant's diff: the others still count)
        print(f"no diff for {name}: {exc!r}", file=sys.stderr)
        out[name] = ["not checked", None]
print(json.dumps(out))
"""
KILLED = frozenset({"killed", "timeout", "segfault", "caught by type check"})
UNCHECKED = frozenset({"not checked", "check was interrupted by user"})


@dataclass
class Result:
    """What one module's run found."""

    name: str
    statuses: dict[str, str] = field(default_factory=dict)
    survivors: dict[str, str] = field(default_factory=dict)
    """Each surviving (or untested) mutant's diff."""
    equivalent: dict[str, str] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0
    shared: bool = False
    """Run in one mutmut session with other modules: ``seconds`` is the session's share."""

    def count(self, statuses: frozenset[str]) -> int:
        """How many mutants ended in one of ``statuses``."""
        return sum(1 for status in self.statuses.values() if status in statuses)

    @property
    def checked(self) -> int:
        """Mutants that were run (a time-boxed run may leave some)."""
        return len(self.statuses) - self.count(UNCHECKED)

    @property
    def killed(self) -> int:
        """Mutants a test caught."""
        return self.count(KILLED)

    @property
    def score(self) -> float:
        """Killed, in percent of the mutants checked that are not known equivalents."""
        counted = self.checked - len(self.equivalent)
        if self.statuses and not self.checked:
            return 0.0  # nothing was checked (the time box ran out): no score
        return 100.0 if counted <= 0 else 100.0 * self.killed / counted


def say(text: str = "") -> None:
    """One line of the report."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def mutant_prefix(target: Target) -> str:
    """``torchrunx.launcher.state.failures.``: how mutmut's names of its mutants start."""
    return target.source.removesuffix(".py").replace("/", ".") + "."


def patterns(target: Target) -> list[str]:
    """Mutmut's mutant-name patterns for the functions of ``target`` that are mutated."""
    prefix = mutant_prefix(target)
    if not target.functions:
        return [prefix + "*"]
    out = []
    for function in target.functions:
        cls, _, name = function.rpartition(".")
        out.append(
            f"{prefix}x\u01c1{cls}\u01c1{name}__mutmut_*" if cls else f"{prefix}x_{name}__mutmut_*"
        )
    return out


def toml_list(values: list[str]) -> str:
    """A TOML array of strings (JSON's string syntax is TOML's basic string)."""
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def prepare(workdir: Path, targets: list[Target]) -> None:
    """A copy of the package and the tests, configured to mutate ``targets`` only."""
    shutil.copytree(
        ROOT / "torchrunx", workdir / "torchrunx", ignore=shutil.ignore_patterns("__pycache__")
    )
    (workdir / "tests").mkdir()
    for path in (ROOT / "tests").glob("*.py"):
        shutil.copy2(path, workdir / "tests" / path.name)
    conftest = workdir / "tests" / "conftest.py"
    conftest.write_text(conftest.read_text() + GUARD)
    tests = list(dict.fromkeys(test for target in targets for test in target.tests))
    missing = [test for test in tests if not (ROOT / test.split("::")[0]).is_file()]
    if missing:
        raise FileNotFoundError(f"guarding tests not found: {missing}")
    selection = [*tests]
    for test in (*IMPURE, *SOURCE_READERS):
        if test.split("::")[0] in tests:
            selection += ["--deselect", test]
    pyproject = (ROOT / "pyproject.toml").read_text()
    if "[tool.mutmut]" in pyproject:
        raise ValueError("pyproject.toml has a [tool.mutmut] table: scripts/mutation.py owns it")
    (workdir / "pyproject.toml").write_text(
        pyproject
        + "\n[tool.mutmut]\n"
        + 'source_paths = ["torchrunx"]\n'
        + f"only_mutate = {toml_list([target.source for target in targets])}\n"
        + f"pytest_add_cli_args_test_selection = {toml_list(selection)}\n"
        + 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not cluster and not slurm"]\n'
        + "timeout_multiplier = 3.0\n"
        + "use_git_change_detection = false\n"
    )


def list_mutants(workdir: Path, targets: list[Target]) -> list[list[str]]:
    """Every mutant mutmut makes of each of ``targets`` (its patterns applied), running none.

    One process lists them all: a process per module paid mutmut's import (seconds on a
    loaded machine) 36 times, which took most of CI's time box before mutmut started.
    """
    listed = subprocess.run(
        [sys.executable, "-c", LIST_MUTANTS, *(target.source for target in targets)],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    by_path: dict[str, list[str]] = json.loads(listed.stdout)
    out = []
    for target in targets:
        prefix, wanted = mutant_prefix(target), patterns(target)
        names = [prefix + name for name in by_path[target.source]]
        out.append([n for n in names if any(fnmatch.fnmatchcase(n, p) for p in wanted)])
    return out


def run_mutmut(workdir: Path, selection: list[str], jobs: int, deadline: float) -> str:
    """``mutmut run`` in ``workdir``, interrupted at ``deadline``; its output ("" if it ended)."""
    log = workdir / "mutmut.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", MUTMUT, "run", "--max-children", str(jobs), *selection],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its workers are interrupted with it, as a group
        )
        try:
            left = None if deadline == float("inf") else max(1.0, deadline - time.monotonic())
            code = process.wait(left)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)  # mutmut records what it has checked so far
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return ""
        except BaseException:  # Ctrl-C or SIGTERM here: mutmut's own session goes with us
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if code != 0:
        text = log.read_text(errors="replace").replace("\r", "\n")
        lines = [line for line in text.splitlines() if line.strip() and "⠋" not in line]
        return f"mutmut exited with {code}:\n" + "\n".join(lines[-40:])
    return ""


def read_results(
    workdir: Path, target: Target, names: list[str]
) -> dict[str, tuple[str, str | None]]:
    """Each mutant's status, and the diff of each one that was checked and not killed."""
    meta = workdir / "mutants" / (target.source + ".meta")
    if not meta.exists():  # the time box ran out before mutmut got to this module
        return dict.fromkeys(names, ("not checked", None))
    read = subprocess.run(
        [sys.executable, "-c", READ_RESULTS, str(meta)],
        cwd=workdir,
        input=json.dumps(names),
        capture_output=True,
        text=True,
        check=False,
    )
    if read.stderr:
        sys.stderr.write(f"{target.source}: reading mutmut's results: {read.stderr.strip()}\n")
    if read.returncode != 0:  # counted as not checked: never as killed
        return dict.fromkeys(names, ("not checked", None))
    results: dict[str, list[str | None]] = json.loads(read.stdout)
    return {name: (str(status), diff) for name, (status, diff) in results.items()}


def run_group(  # noqa: PLR0913 (the run's settings, one argument each)
    names: list[str],
    root: Path,
    *,
    jobs: int,
    deadline: float,
    sample: int | None,
    seed: int,
) -> list[Result]:
    """Mutate some modules in one mutmut session; each runs against its guarding tests.

    With one module, only its own guarding tests run. With several (CI's sample), their
    guarding tests are put together: every test is pure, and mutmut runs for each mutant
    only the tests that call the mutated function; one session saves the per-session cost.
    """
    started = time.monotonic()
    targets = [TARGETS[name] for name in names]
    workdir = root / "+".join(names) if len(names) < 4 else root / "group"
    workdir.mkdir()
    prepare(workdir, targets)
    chosen: dict[str, list[str]] = {}
    selection: list[str] = []
    listed = list_mutants(workdir, targets)
    for name, target, every in zip(names, targets, listed, strict=True):
        mutants = every
        if sample is not None and sample < len(every):
            rng = random.Random(f"{seed}:{name}")  # noqa: S311 (a sample, not a secret)
            mutants = sorted(rng.sample(every, sample))
            selection += mutants
        else:
            selection += patterns(target)
        chosen[name] = mutants
    error = run_mutmut(workdir, selection, jobs, deadline)
    if not error:  # a timeout on a busy machine may be the machine's: run those once more
        timed_out = [
            mutant
            for name, target in zip(names, targets, strict=True)
            for mutant, (status, _) in read_results(workdir, target, chosen[name]).items()
            if status == "timeout"
        ]
        if timed_out and time.monotonic() < deadline:
            error = run_mutmut(workdir, timed_out, jobs, deadline)
    results = []
    for name, target in zip(names, targets, strict=True):
        result = Result(name, error=error)
        if not error:
            for mutant, (status, diff) in read_results(workdir, target, chosen[name]).items():
                result.statuses[mutant] = status
                if diff is None:
                    continue
                known = EQUIVALENT.get(mutant)
                if status == "survived" and known is not None and known[0] in diff:
                    result.equivalent[mutant] = diff
                else:
                    result.survivors[mutant] = diff
        result.seconds = (time.monotonic() - started) / len(names)
        result.shared = len(names) > 1
        results.append(result)
    return results


def changed_modules() -> list[str] | None:
    """Modules whose source or guarding tests changed since the merge-base with origin/main.

    None: no such base, or it is HEAD itself (nothing to compare).
    """
    try:
        base = subprocess.run(
            ["git", "merge-base", "HEAD", "origin/main"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        if base == head:
            return None
        diff = subprocess.run(
            ["git", "diff", "--name-only", base, "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    changed = set(diff)
    if "scripts/mutation.py" in changed:  # the mapping itself changed: every module
        return list(TARGETS)
    return [
        name
        for name, target in TARGETS.items()
        if target.source in changed or changed & set(target.tests)
    ]


def report(result: Result, target_percent: float, *, gate: bool = True) -> bool:
    """Print one module's outcome; whether it reached the target (``gate``: it applies)."""
    ok = not result.error and result.score >= target_percent
    mark = ("ok  " if ok else "FAIL") if gate else "    "
    if result.error:
        say(f"{mark} {result.name}: {result.error}")
        return False
    total = len(result.statuses)
    unchecked = total - result.checked
    say(
        f"{mark} {result.name}: {result.killed}/{total} killed"
        f" ({result.count(frozenset({'timeout'}))} by a timeout), {len(result.survivors)} left, "
        f"{len(result.equivalent)} equivalent"
        + (f", {unchecked} not checked (time box)" if unchecked else "")
        + f": {result.score:.1f}%"
        + ("" if result.shared else f" ({result.seconds:.0f} s)")
    )
    for mutant, diff in result.survivors.items():
        say(f"    {result.statuses[mutant]}: {mutant}")
        say("\n".join("        " + line for line in diff.splitlines() if line[:1] in "+-"))
    return ok


def markdown(results: list[Result]) -> str:
    """The score table of docs/mutation.md."""
    rows = [
        "| module | what is mutated | killed / total | equivalent | score | time |",
        "| --- " * 6 + "|",
    ]
    for result in results:
        target = TARGETS[result.name]
        what = target.note or "every function"
        rows.append(
            f"| `{target.source}` | {what} | {result.killed} / {len(result.statuses)} "
            f"({100.0 * result.killed / max(1, len(result.statuses)):.1f}%) | "
            f"{len(result.equivalent)} | {result.score:.1f}% | "
            + ("(one session)" if result.shared else f"{result.seconds:.0f} s")
            + " |"
        )
    return "\n".join(rows)


def run_and_report(
    modules: list[str], args: argparse.Namespace, *, sample: int | None, budget: float | None
) -> bool:
    """Run the modules (CI's sample in one session), print the outcome; whether it is good."""
    started = time.monotonic()
    deadline = started + budget if budget else float("inf")
    work = Path(tempfile.mkdtemp(prefix="torchrunx-mutation-"))
    results: list[Result] = []
    if args.separate:
        groups = [[m] for m in modules]
    elif sample:  # a sample is small: one session for all, whatever its tests import
        groups = [modules]
    else:  # one session, but for the modules that need one of their own
        alone = [[m] for m in modules if TARGETS[m].own_session]
        together = [m for m in modules if not TARGETS[m].own_session]
        groups = [together, *alone] if together else alone
    try:
        for group in groups:
            results += run_group(
                group, work, jobs=args.jobs, deadline=deadline, sample=sample, seed=args.seed
            )
    finally:
        if args.keep:
            say(f"work folder kept: {work}")
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    pooled_sample = bool(args.ci) and len(modules) > 1  # CI's sample: one score for all
    ok = True
    for result in results:
        ok = report(result, args.target, gate=not pooled_sample) and ok
    if pooled_sample:
        pooled = Result("all", error=next((r.error for r in results if r.error), ""))
        for result in results:
            pooled.statuses.update(result.statuses)
            pooled.equivalent.update(result.equivalent)
        checked = len(pooled.statuses) - pooled.count(UNCHECKED)
        ok = (
            not pooled.error and pooled.score >= args.target and checked >= len(pooled.statuses) / 4
        )
        if checked < len(pooled.statuses) / 4:  # a time box that ran out proves nothing
            say(
                f"FAIL: only {checked} of {len(pooled.statuses)} mutants were checked before the "
                "time box ran out (at least a quarter must be)"
            )
        say(
            f"{'ok' if ok else 'FAIL'}: the sample as a whole, {pooled.killed}/"
            f"{len(pooled.statuses)} killed: {pooled.score:.1f}% (the target applies to it)"
        )
    say(f"{len(results)} modules in {time.monotonic() - started:.0f} s; target {args.target:g}%")
    if args.markdown:
        say(markdown(results))
    return ok


def main() -> int:
    """Run the modules asked for; 1 if one is below the target."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument(
        "--ci", action="store_true", help="CI's subset: changed modules or a sample"
    )
    parser.add_argument("--sample", type=int, help="mutants per module, chosen with --seed")
    parser.add_argument("--seed", type=int, default=CI_SEED)
    parser.add_argument("--budget", type=float, help="seconds for the whole run (a time box)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants at once")
    parser.add_argument("--target", type=float, default=TARGET_PERCENT, help="percent killed")
    parser.add_argument(
        "--separate",
        action="store_true",
        help="one mutmut session per module (slower: each pays the set-up; gives each its time)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (mutmut browse)")
    parser.add_argument(
        "--markdown", action="store_true", help="also print docs/mutation.md's table"
    )
    parser.add_argument("--list", action="store_true", help="show the modules and their tests")
    args = parser.parse_args()
    unknown = set(args.modules) - set(TARGETS)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; known: {', '.join(TARGETS)}")
    if args.list:
        for name, target in TARGETS.items():
            say(f"{name}: {target.source} ({target.note or 'every function'})")
            say(f"    mutated: {', '.join(target.functions) or 'every function'}")
            say(f"    tests: {' '.join(target.tests)}")
        return 0
    modules = args.modules or list(TARGETS)
    sample, budget = args.sample, args.budget
    if args.ci:
        changed = None if args.modules else changed_modules()
        if changed is not None:
            say(f"CI: modules changed since the merge-base with origin/main: {changed or 'none'}")
            modules = changed or list(TARGETS)
        if sample is None:  # the same number of mutants in all, over the modules run
            sample = max(CI_SAMPLE, CI_SAMPLE * len(TARGETS) // len(modules))
        budget = CI_BUDGET_S if budget is None else budget
    say(
        f"mutmut over {', '.join(modules)}"
        + (f"; a sample of {sample} mutants per module (seed {args.seed})" if sample else "")
        + (f"; time box {budget:.0f} s" if budget else "")
    )
    # SIGTERM (a timeout, a CI's limit) ends the run as Ctrl-C does: the work folder in the
    # system's temporary folder is removed on the way out (a default SIGTERM left it behind).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    ok = run_and_report(modules, args, sample=sample, budget=budget)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
