"""A property-based fuzz of ``tiered-kv serve``'s settings (tiered_kv/serve_config.py and the
modules it reads values with) and of the --tenant-priorities file (tiered_kv/config.py).

One hostile source at a time (a YAML --config document, an environment variable, a flag, a
tenant file) with wrong types, nested structures, huge, negative or non-finite numbers,
unknown keys, unicode, non-mapping documents, duplicated keys, YAML tags and alias bombs, and
text nested thousands deep. Whatever comes in: a config whose derived values all compute, or a
``ValueError`` of one line, of a bounded length, naming the key, variable or flag; the CLI
exits 0 or 2 with one ``error:`` line and no traceback. Each call is timed: an alias bomb
expanded (into a value or a message) would run for seconds."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tiered_kv.cli import app
from tiered_kv.config import load_tenant_priorities
from tiered_kv.serve_config import SETTINGS, ServeConfig
from tiered_kv.serve_sources import CONFIG_ENV

pytestmark = pytest.mark.timeout(120)  # a hang; each call is also timed
FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CALL_LIMIT_S = 5.0  # far above any call's time; an expanded alias bomb takes longer
FLAGGED = [s for s in SETTINGS if s.option.flag]
BY_NAME = {s.name: s for s in SETTINGS}

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
EDGES = [
    "", " ", "0", "-0", "1", "-1", "65536", "9223372036854775808", "1" * 5000, "nan", "-inf",
    "1e308", "1e309", "4.9e-324", "9" * 400 + ".5k", "9" * 400 + "K", "8k", "1.5K", "auto", "none",
    "true", "off", "[]", '["a", 1]', '["a", "b"]', "[", "{}", '{"temperature": "hot"}',
    '{"method": "ngram", "num_speculative_tokens": -1}', '{"enable_kv_cache_events": 1}',
    "[" * 100_000, '{"a": ' * 50_000, "0x10", "1_000", "١٢٣", "\u2028", "a\nb", "tiny",
]
EDGE_TEXT = st.sampled_from(EDGES)
VALUE_TEXT = st.one_of(
    EDGE_TEXT, TEXT, st.integers().map(str), st.floats().map(repr),
    st.sampled_from(sorted({c for s in SETTINGS for c in (*s.option.choices, *s.option.value_aliases)})),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(), VALUE_TEXT,
)
NESTED = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
RAW_YAML = st.sampled_from([  # what JSON never writes: tags, dates, anchors, block scalars...
    "2001-12-14", "2001-12-14t21:59:43.10-05:00", "!!binary aGVsbG8=", "!!set {a, b}",
    "!!omap [a: 1]", "0o17", "0x1F", "1_000", "+.inf", ".NaN", "~", "!!float 1e400", "!!int x",
    "!!python/object/apply:os.system ['true']", '"\\ud800"', "'", "@", "*undefined", "&x 5",
    "{a: " * 2000 + "1" + "}" * 2000, "[" * 1200 + "]" * 1200,  # deeper than the parser recurses
    "|\n  two\n  lines", "? [a]\n: 1",
])


def bomb(width: int, depth: int) -> str:
    """A flow list whose last item, through aliases, holds ``width ** depth`` strings."""
    levels = [f"&l0 [{', '.join(['lol'] * width)}]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
    return f"[{', '.join(levels)}]"


YAML_EDGES = [  # typed values, which a setting gets unparsed
    "null", "true", "0", "-1", "1.5", ".nan", "-.inf", "1" + "0" * 400, "2001-12-14", "!!binary aGk=",
    "[]", "{}", "[a, 1]", "[a, b]", "{a: 1}", "!!set {a}", bomb(9, 7),
]
VALUES_YAML = st.one_of(
    NESTED.map(json.dumps),  # JSON is YAML
    RAW_YAML, st.sampled_from(YAML_EDGES), st.builds(bomb, st.integers(2, 9), st.integers(1, 7)),
)


def spelled(setting) -> st.SearchStrategy[str]:
    return st.sampled_from([setting.name, setting.name.replace("_", "-")])


@st.composite
def yaml_documents(draw) -> tuple[bytes, list[str]]:
    """A --config file's bytes, and the names an error about it may give."""
    kind = draw(st.sampled_from(["setting", "setting", "settings", "unknown", "document", "garbage"]))
    if kind == "setting":  # a key (maybe twice) of one setting, a value of any kind
        setting = draw(st.sampled_from([*FLAGGED, BY_NAME["secret"]]))
        keys = draw(st.lists(spelled(setting), min_size=1, max_size=2))
        text = "".join(f"{key}: {draw(VALUES_YAML)}\n" for key in keys)
        return text.encode(), ["--config", setting.flag, setting.name]
    if kind == "settings":  # a few settings, each maybe a value it takes (together maybe not)
        chosen = draw(st.lists(st.sampled_from(FLAGGED), min_size=2, max_size=4, unique_by=lambda s: s.name))
        text = "".join(f"{s.name}: {json.dumps(draw(st.sampled_from([*s.option.choices, *EDGES])))}\n"
                       for s in chosen)
        return text.encode(), ["--config", *(s.flag for s in chosen), *(s.name for s in chosen)]
    if kind == "unknown":
        key = draw(TEXT.filter(lambda k: k.replace("-", "_").strip() not in BY_NAME))
        return yaml.safe_dump({key: draw(NESTED)}).encode(), ["--config"]
    if kind == "document":  # not a mapping, empty, several documents, a bomb at the top
        text = draw(st.one_of(
            st.sampled_from(["", "# nothing\n", "---\n", "~\n", "a: 1\n---\nb: 2\n", "\ufeffport: 1\n"]),
            VALUES_YAML,
        ))
        return text.encode(), ["--config"]
    raw = draw(st.binary(max_size=64) | TEXT.map(str.encode) | st.just(b"port: \xff\xfe\n"))
    return raw, ["--config", *(s.flag for s in SETTINGS)]


def check_message(error: ServeConfig | ValueError, names: list[str], given: int) -> None:
    """A ``ValueError`` (a config passes) is one line, not much longer than what was given,
    and names one of ``names``."""
    if not isinstance(error, ValueError):
        return
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) < 3000 + 4 * given, f"{len(message)} characters: {message[:300]}"
    assert any(name in message for name in names), (names, message)


def load(flags: dict | None = None, **kwargs) -> ServeConfig | ValueError:
    """``ServeConfig.load``'s config and the values derived from it, or its ``ValueError``."""
    start = time.monotonic()
    try:
        config = ServeConfig.load(flags, **kwargs)
        config.engine_config(), config.tier_config()
        config.max_request_body_bytes, config.max_inflight, config.model_names
        return config
    except ValueError as e:
        return e
    finally:
        assert time.monotonic() - start < CALL_LIMIT_S


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("config-fuzz")


@FUZZ
@given(yaml_documents())
def test_a_config_file_is_a_config_or_one_line_naming_the_key(work: Path, document):
    raw, names = document
    path = work / "serve.yaml"
    path.write_bytes(raw)
    check_message(load(config_file=path, environ={}), names, len(raw))


VARIABLES = st.one_of(
    st.sampled_from(SETTINGS).map(lambda s: (s.env, [s.env, s.flag, s.name])),
    st.sampled_from([(a.name, [a.name, s.flag]) for s in SETTINGS for a in s.option.env]),
    st.just((CONFIG_ENV, [CONFIG_ENV, "--config"])),
    st.just(("TIERED_KV_NO_SUCH_SETTING", [])),
)


def test_every_setting_takes_every_edge_value_or_says_why(work: Path):
    """Every setting, as a variable, a flag and a YAML key, given every edge value."""
    path = work / "edge.yaml"
    for setting in SETTINGS:
        names = [setting.env, setting.flag, setting.name]
        for text in EDGES:
            check_message(load(environ={setting.env: text}), names, len(text))
            if setting.option.flag:
                check_message(load({setting.name: text}, environ={}), names, len(text))
        for value in YAML_EDGES if setting.option.flag else ():
            path.write_text(f"{setting.name}: {value}\n")
            check_message(load(config_file=path, environ={}), ["--config", *names], len(value))


@settings(FUZZ, max_examples=1000)
@given(VARIABLES, VALUE_TEXT)
def test_an_environment_variable_is_a_config_or_one_line_naming_it(variable, value):
    name, names = variable
    result = load(environ={name: value})
    check_message(result, names, len(value))
    assert names or result == ServeConfig()  # an unknown TIERED_KV_ variable is ignored


@settings(FUZZ, max_examples=1000)
@given(st.sampled_from(FLAGGED), st.one_of(VALUE_TEXT, SCALARS))
def test_a_flag_is_a_config_or_one_line_naming_it(setting, value):
    check_message(load({setting.name: value}, environ={}), [setting.flag, setting.name], len(str(value)))


PRIORITIES = st.dictionaries(
    st.one_of(TEXT, st.integers(), st.none(), st.booleans()),
    st.one_of(st.integers(), st.sampled_from([2**63 - 1, 2**63, -(2**63), 10**400]), NESTED),
    max_size=4,
)
TENANT_FILES = st.one_of(
    PRIORITIES.map(lambda p: yaml.safe_dump(p).encode()),
    PRIORITIES.map(lambda p: json.dumps({str(k): v for k, v in p.items()}).encode()),
    VALUES_YAML.map(lambda v: f"gold: {v}\n".encode()), VALUES_YAML.map(str.encode), st.binary(max_size=32),
)


@FUZZ
@given(TENANT_FILES)
def test_a_tenant_file_is_priorities_or_one_line_naming_it(work: Path, raw):
    path = work / "tenants.yaml"
    path.write_bytes(raw)
    start = time.monotonic()
    try:
        priorities = load_tenant_priorities(path)
    except ValueError as e:
        check_message(e, [str(path)], len(raw))
        served = load({"tenant_priorities": str(path)}, environ={})
        assert isinstance(served, ValueError)
        check_message(served, ["--tenant-priorities"], len(raw))
    else:
        assert all(isinstance(t, str) and t for t in priorities)
        assert all(type(p) is int and -(2**63) <= p < 2**63 for p in priorities.values())
        assert load({"tenant_priorities": str(path)}, environ={}).tier_config().tenant_priorities == priorities
    assert time.monotonic() - start < 2 * CALL_LIMIT_S


CLI_TEXT = VALUE_TEXT.filter(lambda t: "\0" not in t)


@st.composite
def serve_arguments(draw) -> tuple[list[str], dict[str, str], bytes | None]:
    """``tiered-kv serve``'s arguments and environment: flags (vLLM's short forms and `--no-`
    switches too), a positional MODEL, several values, a variable; and a --config file."""
    args: list[str] = []
    for setting in draw(st.lists(st.sampled_from(FLAGGED), max_size=3)):
        flag = draw(st.sampled_from([setting.flag, *setting.option.aliases]))
        if setting.kind is bool:
            args.append(draw(st.sampled_from([flag, "--no-" + setting.flag[2:]])))
        else:
            several = setting.option.parse == "values"
            args += [flag, *draw(st.lists(CLI_TEXT, min_size=0 if several else 1, max_size=2 if several else 1))]
    if draw(st.booleans()):
        args.insert(draw(st.integers(0, len(args))), draw(CLI_TEXT))
    name, _ = draw(VARIABLES)
    env = {name: draw(CLI_TEXT)} if draw(st.booleans()) else {}
    return args, env, draw(st.none() | yaml_documents().map(lambda document: document[0]))


@settings(FUZZ, max_examples=200)  # a CLI run is slower: ~15 ms
@given(serve_arguments())
def test_the_serve_command_starts_or_says_why_in_one_line(work: Path, arguments):
    from tiered_kv import server

    args, env, config = arguments
    if config is not None:
        (work / "cli.yaml").write_bytes(config)
        args = [*args, "--config", str(work / "cli.yaml")]
    started: list[ServeConfig] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "run", lambda config, ignored_flags=(): started.append(config))
        start = time.monotonic()
        result = CliRunner().invoke(app, ["serve", *args], env=env)
        assert time.monotonic() - start < CALL_LIMIT_S
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    if result.exit_code == 0:
        assert len(started) == 1 and isinstance(started[0], ServeConfig), result.output
    else:
        assert result.exit_code == 2 and not started, result.output
        (line,) = result.output.splitlines()
        assert line.startswith("error: ") and "Traceback" not in line, result.output
