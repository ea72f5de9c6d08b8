"""Rules of the launcher's environment variables (``torchrunx/launcher/settings/environ.py``).

Each parser reads the mapping it is given (a dict here); :func:`read_environ` reads them all
once, from the given mapping or else from ``os.environ``. The variables and their values are
those of docs/environment.md. No process starts; ``os.environ`` and ``HOME`` are changed only
through ``monkeypatch``, so nothing leaks into other tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from torchrunx.launcher.settings.environ import (
    DEBUGPY_PORT,
    DEFAULT_HEALTH_HOST,
    DEFAULT_LOG_DIR,
    LauncherEnviron,
    debugpy_from_env,
    health_details_from_env,
    health_host_from_env,
    health_port_from_env,
    health_token_from_env,
    hints_folder,
    launcher_ports,
    log_level_from_env,
    preload_from_env,
    read_environ,
)

READ = (
    "TORCHRUNX_LOG_LEVEL",
    "TORCHRUNX_LOG_DIR",
    "TORCHRUNX_HINTS",
    "TORCHRUNX_CACHE_DIR",
    "XDG_CACHE_HOME",
    "TORCHRUNX_PROGRESS",
    "TORCHRUNX_VIEW",
    "TORCHRUNX_PRELOAD",
    "TORCHRUNX_LAUNCHER_PORT",
    "TORCHRUNX_HEALTH_CHECK_PORT",
    "TORCHRUNX_HEALTH_CHECK_HOST",
    "TORCHRUNX_HEALTH_CHECK_TOKEN",
    "TORCHRUNX_HEALTH_CHECK_DETAILS",
    "TORCHRUNX_POST_MORTEM",
    "TORCHRUNX_DEBUGPY",
)
"""Every variable :func:`read_environ` reads."""


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``os.environ`` without any variable read here, and ``HOME`` a folder of this test."""
    for name in READ:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- read_environ ------------------------------------------------------------------------------


def test_rule_every_variable_is_read_from_the_given_mapping(clean: Path, tmp_path: Path):
    environ = {
        "TORCHRUNX_LOG_LEVEL": "debug",
        "TORCHRUNX_LOG_DIR": str(tmp_path / "logs"),
        "TORCHRUNX_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHRUNX_PROGRESS": "1",
        "TORCHRUNX_VIEW": "0",
        "TORCHRUNX_PRELOAD": "json,numpy",
        "TORCHRUNX_LAUNCHER_PORT": "29500",
        "TORCHRUNX_HEALTH_CHECK_PORT": "8124",
        "TORCHRUNX_HEALTH_CHECK_HOST": "10.0.0.1",
        "TORCHRUNX_HEALTH_CHECK_TOKEN": "secret",
        "TORCHRUNX_HEALTH_CHECK_DETAILS": "1",
        "TORCHRUNX_POST_MORTEM": "1",
        "TORCHRUNX_DEBUGPY": "3:6001",
        "OTHER": "kept",
    }
    got = read_environ(environ)
    assert got == LauncherEnviron(
        environ=environ,
        log_level=logging.DEBUG,
        log_dir=tmp_path / "logs",
        hints=tmp_path / "cache" / "hints",
        progress=True,
        view=False,
        preload=("json", "numpy"),
        launcher_ports=(29500,),
        health_port=8124,
        health_host="10.0.0.1",
        health_token="secret",  # noqa: S106 (a made-up token)
        health_details=True,
        post_mortem=True,
        debugpy=(3, 6001),
    )
    assert got.environ == environ
    assert got.port_text == "29500"


def test_rule_the_defaults_of_an_empty_mapping(clean: Path):
    got = read_environ({})
    assert got == LauncherEnviron(
        environ={},
        log_level=logging.INFO,
        log_dir=Path(DEFAULT_LOG_DIR),
        hints=clean / ".cache" / "torchrunx" / "hints",
        progress=None,
        view=True,
        preload=(),
        launcher_ports=(0,),
        health_port=None,
        health_host="127.0.0.1",
        health_token=None,
        health_details=False,
        post_mortem=False,
        debugpy=None,
    )
    assert DEFAULT_LOG_DIR == "./torchrunx_logs"
    assert got.port_text == ""


def test_rule_the_mapping_is_read_as_it_was_then(clean: Path):
    environ = {"TORCHRUNX_LOG_LEVEL": "WARNING", "A": "1"}
    got = read_environ(environ)
    environ["A"] = "2"
    environ["TORCHRUNX_LAUNCHER_PORT"] = "29400"
    assert got.environ == {"TORCHRUNX_LOG_LEVEL": "WARNING", "A": "1"}  # a copy
    assert got.port_text == ""


def test_rule_without_a_mapping_os_environ_is_read_and_only_then(
    clean: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TORCHRUNX_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("TORCHRUNX_POST_MORTEM", "1")
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_DETAILS", "1")
    from_os = read_environ()
    assert (from_os.log_level, from_os.post_mortem, from_os.health_details) == (
        logging.ERROR,
        True,
        True,
    )
    assert from_os.environ["TORCHRUNX_LOG_LEVEL"] == "ERROR"
    given = read_environ({"TORCHRUNX_POST_MORTEM": "0", "TORCHRUNX_HEALTH_CHECK_DETAILS": "off"})
    assert (given.log_level, given.post_mortem, given.health_details) == (
        logging.INFO,
        False,
        False,
    )


@pytest.mark.parametrize(
    ("value", "log_dir"), [(None, Path("./torchrunx_logs")), ("", None), ("out", Path("out"))]
)
def test_rule_the_log_folder_is_the_default_unless_set_and_none_when_empty(
    clean: Path, value: str | None, log_dir: Path | None
):
    environ = {} if value is None else {"TORCHRUNX_LOG_DIR": value}
    assert read_environ(environ).log_dir == log_dir


@pytest.mark.parametrize(
    ("value", "shown"), [(None, True), ("1", True), ("", True), ("yes", True), ("0", False)]
)
def test_rule_hints_are_off_only_with_hints_0(clean: Path, value: str | None, shown: bool):
    environ = {"TORCHRUNX_CACHE_DIR": "/c"}
    if value is not None:
        environ["TORCHRUNX_HINTS"] = value
    assert read_environ(environ).hints == (Path("/c/hints") if shown else None)


@pytest.mark.parametrize(
    ("value", "progress"),
    [(None, None), ("", None), ("1", True), ("0", False), ("yes", None), ("2", None)],
)
def test_rule_progress_is_forced_by_1_or_0_only(
    clean: Path, value: str | None, progress: bool | None
):
    environ = {} if value is None else {"TORCHRUNX_PROGRESS": value}
    assert read_environ(environ).progress is progress


@pytest.mark.parametrize(("value", "view"), [(None, True), ("1", True), ("", True), ("0", False)])
def test_rule_the_view_is_off_only_with_view_0(clean: Path, value: str | None, view: bool):
    environ = {} if value is None else {"TORCHRUNX_VIEW": value}
    assert read_environ(environ).view is view


def test_rule_a_bad_value_is_refused_whatever_os_environ_says(
    clean: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TORCHRUNX_POST_MORTEM", "1")
    with pytest.raises(ValueError, match=r"^TORCHRUNX_POST_MORTEM='maybe' is not one of"):
        read_environ({"TORCHRUNX_POST_MORTEM": "maybe"})
    with pytest.raises(ValueError, match=r"^TORCHRUNX_HEALTH_CHECK_DETAILS='sure' is not one"):
        read_environ({"TORCHRUNX_HEALTH_CHECK_DETAILS": "sure"})


# -- hints_folder ------------------------------------------------------------------------------


def test_rule_the_hints_folder_is_the_cache_dir_then_xdg_then_home(clean: Path):
    both = {"TORCHRUNX_CACHE_DIR": "/own", "XDG_CACHE_HOME": "/xdg"}
    assert hints_folder(both) == Path("/own/hints")
    assert hints_folder({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/torchrunx/hints")
    assert hints_folder({}) == clean / ".cache" / "torchrunx" / "hints"
    empty = {"TORCHRUNX_CACHE_DIR": "", "XDG_CACHE_HOME": ""}  # empty is unset
    assert hints_folder(empty) == clean / ".cache" / "torchrunx" / "hints"


# -- preload_from_env --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("", ()),
        ("  ", ()),
        ("numpy", ("numpy",)),
        (" numpy , json.decoder ,x ", ("numpy", "json.decoder", "x")),
    ],
)
def test_rule_preload_is_module_names_separated_by_commas(value: str, names: tuple[str, ...]):
    assert preload_from_env({"TORCHRUNX_PRELOAD": value}) == names
    assert preload_from_env({}) == ()


def test_rule_a_bad_preload_names_every_bad_entry_and_the_form():
    with pytest.raises(ValueError, match=r"^TORCHRUNX_PRELOAD=") as raised:
        preload_from_env({"TORCHRUNX_PRELOAD": " numpy, a b,,x/y "})
    assert str(raised.value) == (
        "TORCHRUNX_PRELOAD='numpy, a b,,x/y': 'a b', '', 'x/y' is not a module name; give "
        "importable module names separated by commas, e.g. TORCHRUNX_PRELOAD=transformers,numpy"
    )


# -- log_level_from_env ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "level"),
    [
        (None, logging.INFO),
        ("DEBUG", logging.DEBUG),
        (" warning ", logging.WARNING),
        ("Error", logging.ERROR),
        ("30", 30),
        (" 5 ", 5),
        ("0", 0),
    ],
)
def test_rule_the_log_level_is_a_name_in_any_case_or_a_number(value: str | None, level: int):
    environ = {} if value is None else {"TORCHRUNX_LOG_LEVEL": value}
    assert log_level_from_env(environ) == level


@pytest.mark.parametrize("value", ["LOUD", " loud ", "-10", "1.5", ""])
def test_rule_any_other_log_level_is_an_error(value: str):
    with pytest.raises(ValueError, match=r"^TORCHRUNX_LOG_LEVEL=") as raised:
        log_level_from_env({"TORCHRUNX_LOG_LEVEL": value})
    assert str(raised.value) == (
        f"TORCHRUNX_LOG_LEVEL={value.strip()!r} is not a logging level (DEBUG, INFO, WARNING, ...)"
    )


# -- launcher_ports ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ports"),
    [
        (None, (0,)),
        ("", (0,)),
        ("  ", (0,)),
        ("1", (1,)),
        ("65535", (65535,)),
        (" 29400 ", (29400,)),
        ("29400-29400", (29400,)),
        ("29400-29402", (29400, 29401, 29402)),
        (" 29400 - 29401 ", (29400, 29401)),
        ("65534-65535", (65534, 65535)),
        ("1-2", (1, 2)),
    ],
)
def test_rule_the_launcher_port_is_one_port_or_a_range(value: str | None, ports: tuple[int, ...]):
    assert launcher_ports({} if value is None else {"TORCHRUNX_LAUNCHER_PORT": value}) == ports


@pytest.mark.parametrize(
    "value",
    ["0", "65536", "0-5", "5-65536", "29410-29400", "29400-", "-29400", "abc", "abc-29400", "1.5"],
)
def test_rule_any_other_launcher_port_is_an_error(value: str):
    with pytest.raises(ValueError, match=r"^TORCHRUNX_LAUNCHER_PORT=") as raised:
        launcher_ports({"TORCHRUNX_LAUNCHER_PORT": f" {value} "})
    assert str(raised.value) == (
        f"TORCHRUNX_LAUNCHER_PORT={value!r}: expected a port from 1 to 65535 (29400) or a range "
        "of them (29400-29409), the lower first"
    )


# -- health_port_from_env, health_host_from_env, health_token_from_env, details ----------------


@pytest.mark.parametrize(
    ("field", "value", "port"),
    [
        (None, None, None),
        (None, "", None),
        (None, " ", None),
        (None, "0", 0),
        (None, " 8080 ", 8080),
        (None, "65535", 65535),
        (None, "00080", 80),
        (0, "8080", 0),
        (65535, None, 65535),
        (9000, "junk", 9000),  # the field wins: the variable is not read
    ],
)
def test_rule_the_health_port_is_the_field_else_the_variable(
    field: int | None, value: str | None, port: int | None
):
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_PORT": value}
    assert health_port_from_env(field, environ) == port


@pytest.mark.parametrize("value", ["65536", "-1", "http", "80.0", "+80", "000080", " 99999 "])
def test_rule_any_other_health_port_variable_is_an_error(value: str):
    with pytest.raises(ValueError, match=r"^TORCHRUNX_HEALTH_CHECK_PORT=") as raised:
        health_port_from_env(None, {"TORCHRUNX_HEALTH_CHECK_PORT": value})
    assert str(raised.value) == (
        f"TORCHRUNX_HEALTH_CHECK_PORT={value!r} is not a port number (an integer from 0 to "
        "65535; 0: any free port; empty or unset: no health endpoint)"
    )


@pytest.mark.parametrize("field", [-1, 65536])
def test_rule_a_health_port_field_out_of_range_is_an_error(field: int):
    with pytest.raises(ValueError, match=r"^health_check_port=") as raised:
        health_port_from_env(field, {})
    assert str(raised.value) == (
        f"health_check_port={field} is not a port number (an integer from 0 to 65535; 0: any "
        "free port)"
    )


@pytest.mark.parametrize("field", [True, False, 80.0, "80"])
def test_rule_a_health_port_field_that_is_not_an_int_is_a_type_error(field: object):
    with pytest.raises(TypeError) as raised:
        health_port_from_env(field, {})  # type: ignore[arg-type]
    assert str(raised.value) == f"health_check_port must be an int or None, not {field!r}"


@pytest.mark.parametrize(
    ("value", "host"),
    [
        (None, "127.0.0.1"),
        ("", "127.0.0.1"),
        ("  ", "127.0.0.1"),
        ("*", ""),
        (" * ", ""),
        ("**", "**"),
        (" 0.0.0.0 ", "0.0.0.0"),  # noqa: S104 (an address as a value)
        ("node1", "node1"),
    ],
)
def test_rule_the_health_host_is_loopback_unless_set_and_star_is_every_interface(
    value: str | None, host: str
):
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_HOST": value}
    assert health_host_from_env(environ) == host
    assert DEFAULT_HEALTH_HOST == "127.0.0.1"


@pytest.mark.parametrize(
    ("value", "token"), [(None, None), ("", None), ("  ", None), (" t0k ", "t0k"), ("a b", "a b")]
)
def test_rule_the_health_token_is_the_stripped_value_or_none(value: str | None, token: str | None):
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_TOKEN": value}
    assert health_token_from_env(environ) == token


@pytest.mark.parametrize(
    ("value", "details"),
    [(None, False), ("", False), ("0", False), ("OFF", False), ("1", True), (" Yes ", True)],
)
def test_rule_health_details_is_a_yes_no_flag(
    clean: Path, value: str | None, details: bool, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_DETAILS", "0" if details else "1")  # not read
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_DETAILS": value}
    assert health_details_from_env(environ) is details
    with pytest.raises(ValueError, match=r"^TORCHRUNX_HEALTH_CHECK_DETAILS='2' is not one of"):
        health_details_from_env({"TORCHRUNX_HEALTH_CHECK_DETAILS": "2"})


# -- debugpy_from_env --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "chosen"),
    [
        (None, None),
        ("  ", None),
        ("0", (0, DEBUGPY_PORT)),
        ("5:", (5, 5678)),
        (" 2:1 ", (2, 1)),
        ("12:65535", (12, 65535)),
    ],
)
def test_rule_debugpy_is_a_rank_and_maybe_a_port(value: str | None, chosen: tuple[int, int] | None):
    environ = {} if value is None else {"TORCHRUNX_DEBUGPY": value}
    assert debugpy_from_env(environ) == chosen
    assert DEBUGPY_PORT == 5678


@pytest.mark.parametrize("value", ["x", "1:0", "1:65536", ":1", "1:2:3", "-1", " 1 :2"])
def test_rule_any_other_debugpy_is_an_error(value: str):
    with pytest.raises(ValueError, match=r"^TORCHRUNX_DEBUGPY=") as raised:
        debugpy_from_env({"TORCHRUNX_DEBUGPY": value})
    assert str(raised.value) == (
        f"TORCHRUNX_DEBUGPY={value.strip()!r} is not RANK or RANK:PORT (a rank from 0, a port "
        "from 1 to 65535), for example 0 or 1:5678"
    )
