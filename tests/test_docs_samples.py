"""Every sample of torchrunx's output in the docs is what the code prints today.

A block of output in ``README.md`` or ``docs/*.md`` (a dry run, an error message, ``--help``,
a hint, a table, the JSON of an event or of ``/health``, ``torchrunx check``'s lines) follows a
line ``<!-- sample: NAME -->``; ``tests/doc_samples.py`` makes ``NAME``'s text with the real code
(fixed values where the sample shows hosts, pids or times), and the block must be exactly that
text (trailing spaces aside). A marked Markdown table (rows starting with ``|``) is a block
too. The samples made in this process are in the quick tier (``doc_samples.QUICK``).

To bring the docs up to date after a change of the code, write the samples into the pages::

    TORCHRUNX_WRITE_SAMPLES=1 .venv/bin/python -m pytest tests/test_docs_samples.py

Every other block that is not code the reader writes (a fence without a language, ``text``,
``console``, ``json``, ``pycon``, or one with a ``$ `` or ``>>> `` prompt) must be listed in
:data:`HAND_WRITTEN` with the reason it cannot be made by the code, and be marked on its page
by a line ``<!-- illustrative -->`` before it: a new hand-written block of output fails here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path

import doc_samples
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^ *<!-- sample: ([a-z0-9-]+) -->$")
ILLUSTRATIVE = re.compile(r"^ *<!-- illustrative -->$")
"""Before a block that no code makes (listed in :data:`HAND_WRITTEN`, with the reason)."""
WRITE = os.environ.get("TORCHRUNX_WRITE_SAMPLES") == "1"
CODE_LANGUAGES = {"python", "bash", "toml", "yaml"}
"""Fences of code the reader writes (unless a line of theirs is a prompt: then output too)."""

HAND_WRITTEN: dict[tuple[str, str], str] = {
    # (page, the start of the block's first line): why no code makes it
    ("docs/debugging.md", "--- pdb: rank 1 on node2 at /home/me/train.py:42 in train ---"): (
        "an interactive pdb session: what the reader types and pdb answers"
    ),
    ("docs/health.md", "$ curl -s http://node1:8080/health | python -m json.tool"): (
        "commands the reader types; the one output line is curl's (the status code)"
    ),
    ("docs/how_it_works.md", " your process                                   every host"): (
        "a drawing of the packages"
    ),
    ("docs/how_it_works.md", " your process: the launcher side                         ever"): (
        "a drawing of the imports (tests/test_layout.py checks the rule it draws)"
    ),
    ("docs/how_it_works.md", "launcher: your Python process (the thread that called run)   "): (
        "a drawing of the process tree"
    ),
    ("docs/how_it_works.md", "export NAME1=<value> NAME2=<value> ...; cd <launcher cwd> && s"): (
        "the script's shape, with placeholders for what changes with every launch"
    ),
    ("docs/how_it_works.md", '{"host_index": 0, "hostname": "node1", "launcher": [ADDRESS, '): (
        "the bootstrap's fields and their types, with placeholders"
    ),
    ("docs/how_it_works.md", "launcher (server)                                   agent or "): (
        "a drawing of the handshake"
    ),
    ("docs/how_it_works.md", "!I  length of what follows (the ciphertext and its 16-byte tag"): (
        "the layout of a sealed record"
    ),
    ("docs/how_it_works.md", "!Q  header length"): "the layout of a frame",
    ("docs/how_it_works.md", "launcher                         agent                        w"): (
        "a drawing of the messages of a launch"
    ),
    ("docs/security.md", "launcher (server)                                   agent or "): (
        "a drawing of the handshake"
    ),
    ("docs/slurm.md", "# hostfile: one host per line"): "a file the reader writes",
    ("docs/logging.md", "torchrunx_logs/"): (
        "a drawing of a launch's folder, annotated (tests/test_logs.py checks the names)"
    ),
    ("docs/logging.md", "[node1] agent of host 0 started on node1"): (
        "the agent's lines of a real launch, whose two workers end in either order "
        "(tests/test_logs.py checks these lines)"
    ),
}


@dataclass(frozen=True)
class Block:
    """A fenced block (or a marked table) of a page."""

    page: str
    """Its page, from the repository's root (``docs/cli.md``)."""
    line: int
    """The number of its first line of text (1-based)."""
    name: str | None
    """The sample it shows, if marked."""
    language: str
    indent: str
    lines: tuple[str, ...]
    """Its text, the indentation of its fence taken off."""
    illustrative: bool = False
    """Whether ``<!-- illustrative -->`` precedes it: written by hand, not made by the code."""


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, and every table that follows a sample's marker."""
    lines = page.read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        marker = MARKER.match(lines[index])
        fence = re.match(r"^( *)```(\S*)", lines[index])
        name = marker.group(1) if marker else None
        if marker and lines[index + 1].lstrip().startswith("|"):
            end = index + 1
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            found.append(_block(page, lines, (index + 1, end), name, ("", "table")))
            index = end
            continue
        illustrative = ILLUSTRATIVE.match(lines[index]) is not None
        if marker or illustrative:
            index += 1
            fence = re.match(r"^( *)```(\S*)", lines[index])
            assert fence, f"{page.name}:{index + 1}: a fence or a table must follow the marker"
        if fence:
            indent, language = fence.group(1), fence.group(2)
            end = index + 1
            while lines[end].strip() != "```":
                end += 1
            block = _block(page, lines, (index + 1, end), name, (indent, language))
            found.append(dataclasses.replace(block, illustrative=illustrative))
            index = end
        index += 1
    return found


def _block(
    page: Path, lines: list[str], span: tuple[int, int], name: str | None, fence: tuple[str, str]
) -> Block:
    """The block of ``lines[start:end]``; ``fence``: its indentation and language."""
    (start, end), (indent, language) = span, fence
    text = tuple(line.removeprefix(indent) for line in lines[start:end])
    return Block(str(page.relative_to(ROOT)), start + 1, name, language, indent, text)


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
SAMPLES = [block for block in ALL_BLOCKS if block.name is not None]


def _is_output(block: Block) -> bool:
    """Whether a block shows what a program printed, rather than code the reader writes."""
    prompt = any(line.startswith(("$ ", ">>> ")) for line in block.lines)
    return block.language not in CODE_LANGUAGES or prompt


def _write(block: Block, text: list[str]) -> None:
    """Put ``text`` in place of the block of ``block.name`` on its page."""
    page = ROOT / block.page
    lines = page.read_text().splitlines()
    for found in blocks(page):
        if found.name == block.name and found.lines != tuple(text):
            start = found.line - 1
            lines[start : start + len(found.lines)] = [
                (found.indent + line).rstrip() for line in text
            ]
            page.write_text("\n".join(lines) + "\n")
            return


def _marks(name: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.quick] if name in doc_samples.QUICK else []


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=_marks(b.name or ""), id=f"{b.page}:{b.name}") for b in SAMPLES],
)
def test_the_sample_is_what_the_code_prints(block, tmp_path, monkeypatch):
    assert block.name in doc_samples.SAMPLES, f"{block.page}: no code makes sample {block.name!r}"
    text = doc_samples.SAMPLES[block.name](doc_samples.Place(tmp_path, monkeypatch))
    made = [line.rstrip() for line in text.rstrip("\n").split("\n")]  # no trailing spaces
    if WRITE:
        _write(block, made)
        return
    assert list(block.lines) == made, (
        f"{block.page}:{block.line}: the sample {block.name!r} is not what the code prints "
        "(TORCHRUNX_WRITE_SAMPLES=1 writes it):\n" + "\n".join(made)
    )


def _hand_written(block: Block) -> tuple[str, str] | None:
    """The entry of :data:`HAND_WRITTEN` that lists ``block``, if one does."""
    first = block.lines[0] if block.lines else ""
    return next(
        (key for key in HAND_WRITTEN if key[0] == block.page and first.startswith(key[1])), None
    )


@pytest.mark.quick
def test_every_block_of_output_is_made_by_the_code_or_listed_as_hand_written():
    unmarked = [block for block in ALL_BLOCKS if block.name is None and _is_output(block)]
    new = [block for block in unmarked if _hand_written(block) is None]
    assert not new, (
        "blocks of output that no test makes: mark each with <!-- sample: NAME --> and add NAME "
        "to tests/doc_samples.py (or, if no code can make it, list it in HAND_WRITTEN with why):\n"
        + "\n".join(f"{b.page}:{b.line}: {b.lines[0]!r}" for b in new)
    )
    listed = {_hand_written(block) for block in unmarked}
    assert set(HAND_WRITTEN) <= listed, "HAND_WRITTEN lists a block that is gone or marked"
    unsaid = [block for block in unmarked if not block.illustrative]
    assert not unsaid, (
        "blocks of HAND_WRITTEN that the page does not mark: put <!-- illustrative --> before "
        "each, so that the reader of the Markdown knows no test makes it:\n"
        + "\n".join(f"{b.page}:{b.line}: {b.lines[0]!r}" for b in unsaid)
    )


@pytest.mark.quick
def test_a_block_marked_illustrative_is_listed_with_its_reason():
    marked = [block for block in ALL_BLOCKS if block.illustrative]
    assert marked
    unlisted = [block for block in marked if _hand_written(block) is None]
    assert not unlisted, "\n".join(f"{b.page}:{b.line}: {b.lines[0]!r}" for b in unlisted)


@pytest.mark.quick
def test_every_sample_the_code_makes_is_shown_somewhere():
    assert set(doc_samples.SAMPLES) == {block.name for block in SAMPLES}


# -- the points of issue #47 item 9 ------------------------------------------------------------


@pytest.mark.quick
def test_the_command_pages_option_list_names_every_option():
    import argparse

    from torchrunx.cli import add_launcher_arguments

    parser = argparse.ArgumentParser()
    add_launcher_arguments(parser)
    options = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    options -= {"--help"}
    text = (ROOT / "docs" / "cli.md").read_text()
    paragraph = text[text.index("The options are the `Launcher` fields") :]
    paragraph = paragraph[: paragraph.index("\n\n")]
    named = set(re.findall(r"`(--[a-z-]+)`", paragraph))
    assert options - named == set()


@pytest.mark.quick
def test_the_environment_pages_two_forms_of_extra_env_vars_forward_what_it_says(monkeypatch):
    import torchrunx as trx

    page = (ROOT / "docs" / "environment.md").read_text()
    assert "copies HF_* from the launcher" in page
    assert "Only sets WANDB_PROJECT=demo (the dict form holds values, no patterns)" in page
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)

    def forwarded(extra: object) -> dict[str, str]:
        env = trx.Launcher(hostnames=["localhost"], extra_env_vars=extra).plan().reach.env
        return {k: v for k, v in env.items() if k.startswith(("HF_", "WANDB_"))}

    both = forwarded(("HF_*", "WANDB_PROJECT=demo"))
    assert both == {"HF_HOME": "/data/hf", "WANDB_PROJECT": "demo"}
    assert forwarded({"WANDB_PROJECT": "demo"}) == {"WANDB_PROJECT": "demo"}


@pytest.mark.quick
def test_the_dry_run_samples_name_where_the_hosts_come_from_and_how_agents_start():
    for block in SAMPLES:
        if block.name in {"cli-dry-run", "index-dry-run"}:
            assert "hosts from: the list given" in block.lines
            assert "agent start: local (1 host)" in block.lines
    assert {"cli-dry-run", "index-dry-run"} <= {block.name for block in SAMPLES}


@pytest.mark.quick
def test_the_command_page_shows_torchruns_options():
    assert "cli-torchrun-table" in {b.name for b in SAMPLES if b.page == "docs/cli.md"}


@pytest.mark.quick
def test_no_sample_message_sends_the_reader_to_a_file_of_the_repository():
    # What a user's terminal shows points at the docs site's pages, not at docs/*.md or tests/
    # of a checkout they may not have (the breakpoint message did).
    from torchrunx.worker.debugger import skipped_text

    assert not re.search(r"\b(docs|tests|scripts)/", skipped_text("/home/me/train.py:41", 1))
    for block in SAMPLES:
        assert not re.search(r"\b(docs|tests|scripts)/\w+\.(md|py)", "\n".join(block.lines))


@pytest.mark.quick
def test_the_ssh_reasons_on_the_errors_page_are_what_the_code_says():
    """Each reason of docs/errors.md's SSH table, made by the code with the page's placeholders.

    ``_ssh_error`` is given the user ``USER`` and host ``HOST``; the port 2222 and the timeout
    7 s, numbers in the code, are then written ``PORT`` and ``T``; an exception whose own words
    the page leaves out says ``...``.
    """
    import socket

    import paramiko

    from torchrunx.engines.ssh import SshTarget, _ssh_error

    target = SshTarget(
        alias="HOST",
        hostname="HOST",
        port=2222,
        user="USER",
        identity_files=(),
        identities_only=False,
        known_hosts_files=(),
        strict_host_key_checking="yes",
        connect_timeout=7.0,
        proxy_jump=None,
        proxy_command=None,
    )

    class BadHostKey(paramiko.BadHostKeyException):
        def __init__(self) -> None:
            Exception.__init__(self)

        def __str__(self) -> str:
            return "..."

    client = paramiko.SSHClient()
    client._transport = types.SimpleNamespace(_log=lambda *_: None)  # no connection: no log
    try:  # paramiko's own words for a host missing from known_hosts
        paramiko.RejectPolicy().missing_host_key(client, "...", paramiko.RSAKey.generate(1024))
    except paramiko.SSHException as exc:
        unknown: BaseException = exc
    faults: list[BaseException] = [
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        ConnectionRefusedError(),
        TimeoutError(),
        OSError("the error"),
        paramiko.AuthenticationException("..."),
        unknown,
        BadHostKey(),
        paramiko.SSHException("..."),
    ]
    page = (ROOT / "docs" / "errors.md").read_text()
    for fault in faults:
        reason = _ssh_error(target, fault).reason
        reason = reason.replace("2222", "PORT").replace(" 7 s ", " T s ")
        reason = reason.split("; connect once with `ssh`")[0]  # the page says the hint in words
        assert f"`{reason}`" in page, reason


@pytest.mark.quick
def test_the_pickling_error_on_the_errors_page_is_what_the_code_says():
    """``dumps_call``'s error for an argument that cannot be pickled, as the page has it.

    The argument is a lock; the function's name is written ``NAME``, pickle's own words ``REASON``.
    """
    import threading

    from torchrunx.errors import SerializationError
    from torchrunx.serialization import dumps_call

    def train() -> None: ...

    train.__qualname__ = "NAME"
    with pytest.raises(SerializationError) as raised:
        dumps_call(train, (threading.Lock(),), {})
    message = str(raised.value).replace(str(raised.value.__cause__), "REASON")
    page = (ROOT / "docs" / "errors.md").read_text()
    assert f"`SerializationError: {message}`" in page, message
