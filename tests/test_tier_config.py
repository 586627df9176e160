"""TierConfig's tenant priorities and the file they are read from."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv.config import TierConfig, load_tenant_priorities


def test_a_tenant_has_its_listed_priority_and_everyone_else_zero():
    config = TierConfig(tenant_priorities={"gold": -10, "batch": 10})
    assert config.tenant_priority("gold") == -10 and config.tenant_priority("batch") == 10
    assert config.tenant_priority("other") == config.tenant_priority(None) == 0
    assert TierConfig().tenant_priority("gold") == 0


@pytest.mark.parametrize("text", ["gold: -10\nbatch: 10\n", '{"gold": -10, "batch": 10}'])
def test_priorities_load_from_yaml_or_json(tmp_path: Path, text: str):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    assert load_tenant_priorities(path) == {"gold": -10, "batch": 10}


def test_an_empty_file_lists_no_tenant(tmp_path: Path):
    path = tmp_path / "tenants.yaml"
    path.write_text("# nobody yet\n")
    assert load_tenant_priorities(path) == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("- gold\n- batch\n", "must map tenants to integers"),
        ("gold: high\n", "tenant 'gold': the priority must be an integer"),
        ("gold: 1.5\n", "the priority must be an integer"),
        ("gold: true\n", "the priority must be an integer"),
        ("1: 3\n", "a tenant must be a non-empty string"),
        ("gold: [1\n", "cannot read the tenant priorities"),
        # a list of 9**7 strings through aliases: its repr was the message, 30 MB long
        ("gold: [&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]" + "".join(
            f", &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 7)) + "]\n",
         r"the priority must be an integer, got \[\['lol',"),
        ("gold: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML: nested too deeply"),  # RecursionError
        ("gold: !!int x\n", "cannot read the tenant priorities .*: not valid YAML"),  # the file unnamed
    ],
)
def test_a_bad_file_is_one_clear_error_naming_it(tmp_path: Path, text: str, message: str):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_tenant_priorities(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert len(str(info.value)) < 500, str(info.value)[:500]


def test_a_missing_file_and_a_bad_mapping_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read the tenant priorities"):
        load_tenant_priorities(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="the priority must be an integer"):
        TierConfig(tenant_priorities={"gold": 2**63})
