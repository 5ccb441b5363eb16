"""MIGPolicyConfig from traitlets config, and loading jupyterhub_config.d like a hub does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config, PyFileConfigLoader

from mig_spawner.config import MIGPolicyConfig, load_config_files, offered_profiles_from_config
from mig_spawner.core.catalog import model
from mig_spawner.core.policy import PolicyError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "jupyterhub_config.d"

BRIEF_EXAMPLE = """
c.MIGPolicyConfig.group_policies = {"analysts": {
    "allowed": ["1g.18gb", "2g.35gb"], "max_slices_per_user": 1, "quota_slices": 6,
    "server_idle_timeout": "30m", "kernel_idle_timeout": "15m", "max_session_age": "8h"}}
"""


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def test_every_trait_is_configurable_and_explained() -> None:
    traits = MIGPolicyConfig.class_traits(config=True)
    assert set(traits) == {"offers", "slice_classes", "group_policies", "default_policy"}
    for name, trait in traits.items():
        assert len(trait.help) > 40, name


def test_a_config_file_as_in_the_docs_builds_a_policy(tmp_path: Path) -> None:
    write(tmp_path, "20-groups.py", BRIEF_EXAMPLE)
    policies = MIGPolicyConfig(config=load_config_files(tmp_path)).build([model("h200")])
    analysts = policies.group("analysts")
    assert analysts.allowed == ("1g.18gb", "2g.35gb")
    assert (
        analysts.server_idle_timeout,
        analysts.kernel_idle_timeout,
        analysts.max_session_age,
    ) == (1800, 900, 28800)
    assert policies.for_user(["analysts"]).max_slices == 1
    # Nobody else gets a GPU unless default_policy says so.
    assert not policies.for_user(["students"]).has_gpu_access


def test_build_reports_mistakes_with_group_and_key() -> None:
    config = Config()
    config.MIGPolicyConfig.group_policies = {
        "analysts": {"allowed": ["3g.40gb"], "quota_slices": -1}
    }
    with pytest.raises(PolicyError) as err:
        MIGPolicyConfig(config=config).build([model("h200")])
    allowed, quota = err.value.problems
    assert allowed.startswith("group 'analysts': allowed: profile '3g.40gb' exists on no GPU")
    assert quota == (
        "group 'analysts': quota_slices must be a whole number, 0 or more "
        "(or None for no limit), got -1"
    )


def test_a_policy_that_is_not_a_dict_fails_when_the_config_is_applied() -> None:
    config = Config()
    config.MIGPolicyConfig.group_policies = [{"allowed": ["1g.18gb"]}]
    with pytest.raises(TraitError, match=r"'group_policies' trait .* expected a dict"):
        MIGPolicyConfig(config=config)


def test_files_load_in_sorted_order_and_later_ones_can_extend(tmp_path: Path) -> None:
    conf = tmp_path / "jupyterhub_config.d"
    write(
        conf,
        "30-extra.py",
        'c.MIGPolicyConfig.group_policies.update({"interns": {"allowed": ["1g.18gb"]}})\n',
    )
    write(conf, "20-groups.py", BRIEF_EXAMPLE)
    write(
        conf,
        "10-base.py",
        'c.MIGPolicyConfig.group_policies = {"old": {"allowed": []}}\n'
        'c.MIGPolicyConfig.default_policy = {"allowed": ["1g.18gb"]}\n',
    )
    write(conf, "notes.txt", "not python, not loaded\n")
    policies = MIGPolicyConfig(config=load_config_files(conf)).build()
    # 20 replaced 10's groups, 30 extended 20's; 10's default survived.
    assert sorted(policies.groups) == ["analysts", "interns"]
    assert policies.default.allowed == ("1g.18gb",)


def test_same_result_as_load_subconfig_in_a_jupyterhub_config(tmp_path: Path) -> None:
    """What a hub's own jupyterhub_config.py does with the directory, per the convention."""
    conf = tmp_path / "jupyterhub_config.d"
    write(conf, "20-groups.py", BRIEF_EXAMPLE)
    write(conf, "30-extra.py", 'c.MIGPolicyConfig.default_policy = {"allowed": ["1g.18gb"]}\n')
    write(
        tmp_path,
        "jupyterhub_config.py",
        "import glob, os\n"
        "for f in sorted(glob.glob(os.path.join(os.path.dirname(__file__),\n"
        "                                       'jupyterhub_config.d', '*.py'))):\n"
        "    load_subconfig(f)\n",
    )
    hub = PyFileConfigLoader("jupyterhub_config.py", path=str(tmp_path)).load_config()
    assert load_config_files(conf) == hub


def test_files_and_directories_can_be_listed(tmp_path: Path) -> None:
    one = write(tmp_path / "a", "50-one.py", "c.MIGPolicyConfig.offers = {'1g.18gb': {}}\n")
    write(tmp_path / "b", "10-two.py", "c.MIGPolicyConfig.offers = {'2g.35gb': {}}\n")
    # Order given wins over names: b/10-two.py is loaded after a/50-one.py.
    config = load_config_files([one, tmp_path / "b"])
    assert config.MIGPolicyConfig.offers == {"2g.35gb": {}}


def test_a_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.d"
    with pytest.raises(FileNotFoundError, match=re.escape(f"config path '{missing}' does not")):
        load_config_files(missing)


def test_an_error_in_a_config_file_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, "20-bad.py", "c.MIGPolicyConfig.group_policies = {\n")
    with pytest.raises(SyntaxError) as err:
        load_config_files(tmp_path)
    assert err.value.filename == str(tmp_path / "20-bad.py")


@pytest.mark.parametrize(
    ("fleet", "expected"),
    [
        (["h200"], {"small": "1g.18gb", "medium": "2g.35gb"}),
        (["a100-80gb", "h200"], {"small": "1g.10gb", "medium": "2g.20gb"}),
    ],
)
def test_shipped_example_builds_for_real_fleets(fleet: list[str], expected: dict) -> None:
    policies = MIGPolicyConfig(config=load_config_files(SHIPPED)).build(
        [model(key) for key in fleet]
    )
    assert {"analysts", "ml-team", "admins"} <= set(policies.groups)
    analysts = policies.for_user(["analysts"])
    assert analysts.offer_keys == ("small", "medium")
    assert {o.key: o.profile_for(fleet[0]) for o in analysts.offers} == expected
    assert all(o.description for o in policies.offers.values())
    # Heavy experiments may not start on the analysts' budget, and vice versa.
    assert not analysts.allows("full")
    assert policies.for_user(["analysts", "admins"]).charge_candidates("small")[0].name == "admins"


def test_doctor_reads_offered_profiles_and_mode(tmp_path: Path) -> None:
    write(tmp_path, "20-groups.py", BRIEF_EXAMPLE)
    assert offered_profiles_from_config(tmp_path) == (["1g.18gb", "2g.35gb"], "pool")
    assert offered_profiles_from_config(SHIPPED, [model("h200")])[0] == [
        "1g.18gb",
        "2g.35gb",
        "3g.71gb",
        "7g.141gb",
        "1g.35gb",
    ]
    write(tmp_path, "10-spawner.py", "c.LocalMIGSpawner.mig_mode = 'dynamic'\n")
    assert offered_profiles_from_config(tmp_path)[1] == "dynamic"
    write(tmp_path, "30-other.py", "c.MIGSpawnerMixin.mig_mode = 'pool'\n")
    with pytest.raises(ValueError, match=r"mig_mode is set differently: c\.LocalMIGSpawner"):
        offered_profiles_from_config(tmp_path)
