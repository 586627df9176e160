"""serve_docs: docs/configuration.md's tables and docs/compatibility.md are what the code says."""
from __future__ import annotations

import pydantic
import pytest

from tiered_kv import serve_docs
from tiered_kv.protocol_errors import RequestError
from tiered_kv.serve_config import SETTINGS
from tiered_kv.vllm_compat import REFUSED_REQUEST_FIELDS, UPSTREAM_REQUEST_FIELDS

BASE = {"completions": {"prompt": "hi"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}


def test_the_docs_are_generated_from_the_code():
    assert serve_docs.main(["--check"]) == 0, "run: python -m tiered_kv.serve_docs"


def test_every_setting_has_a_row_in_configuration_md():
    text = serve_docs.CONFIGURATION.read_text()
    for s in SETTINGS:
        assert f"| `{s.env}`" in text, s.name
    assert serve_docs.settings_table("Engine").count("\n") == 2 + sum(s.option.panel == "Engine" for s in SETTINGS)


def test_a_stale_table_is_rewritten():
    text = serve_docs.CONFIGURATION.read_text()
    start = text.index("<!-- generated: settings Server -->")
    stale = text[:start] + text[start:].replace("| `--port` |", "| `--prt` |", 1)
    assert serve_docs.render_configuration(stale) == text
    with pytest.raises(ValueError, match="no settings panel 'Nope'"):
        serve_docs.render_configuration("<!-- generated: settings Nope -->\n<!-- end of generated settings -->")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_refused_request_fields_are_refused(route):
    model = serve_docs.ROUTES[route]
    for name, refused in REFUSED_REQUEST_FIELDS[route].items():
        body = model.model_validate({**BASE[route], name: refused.example})
        with pytest.raises(RequestError) as e:
            body.to_sampling_params()
        assert e.value.param == name


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_fields_the_schema_does_not_read_are_as_the_docs_say(route):
    model = serve_docs.ROUTES[route]
    text = serve_docs.compatibility()
    for name in set(UPSTREAM_REQUEST_FIELDS[route]) - set(model.model_fields):
        if model.model_config.get("extra") == "forbid":
            with pytest.raises(pydantic.ValidationError):
                model.model_validate({**BASE[route], name: 1})
        else:
            model.model_validate({**BASE[route], name: 1})
        assert f"| `{name}` | {'refused' if model.model_config.get('extra') == 'forbid' else 'ignored'}" in text
