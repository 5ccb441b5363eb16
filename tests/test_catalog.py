"""The MIG catalog: lookups, placement rules and the errors a user sees for bad names."""

from __future__ import annotations

from pathlib import Path

import pytest

from mig_spawner.core import catalog
from mig_spawner.core.catalog import CatalogError


def test_model_lookup_by_key_is_case_and_space_insensitive():
    assert catalog.model(" H200 ").display_name == "H200 141GB"


def test_unknown_model_lists_the_known_keys():
    with pytest.raises(CatalogError) as exc:
        catalog.model("h300")
    assert "'h300'" in str(exc.value)
    for key in ("a100-40gb", "a100-80gb", "a30", "h100", "h200", "b200"):
        assert key in str(exc.value)


@pytest.mark.parametrize(
    ("product", "key"),
    [("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA H100 80GB HBM3", "h100"),
     ("NVIDIA H200", "h200"), ("NVIDIA A30", "a30"), ("nvidia h100 nvl", "h100-nvl")],
)
def test_model_for_product_maps_nvml_names(product, key):
    assert catalog.model_for_product(product).key == key


def test_product_without_mig_is_none_or_a_clear_error():
    assert catalog.find_model_for_product("Tesla T4") is None
    with pytest.raises(CatalogError, match=r"not a MIG-capable GPU.*NVIDIA H200"):
        catalog.model_for_product("Tesla T4")


@pytest.mark.parametrize("name", ["1g.18gb", "MIG 1g.18gb", " 1G.18GB ", "mig-1g.18gb",
                                  "nvidia.com/mig-1g.18gb"])
def test_profile_names_are_normalised(name):
    assert catalog.model("h200").profile(name).name == "1g.18gb"


def test_unknown_profile_lists_the_valid_profiles_of_that_gpu():
    with pytest.raises(CatalogError) as exc:
        catalog.model("a100-40gb").profile("1g.18gb")
    message = str(exc.value)
    assert "'1g.18gb'" in message and "A100 40GB" in message
    assert "1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb" in message


def test_a100_40gb_has_a_double_memory_1g_profile():
    profile = catalog.model("a100-40gb").profile("1g.10gb")
    assert (profile.compute_slices, profile.memory_slices, profile.profile_id) == (1, 2, 15)


def test_parse_profile_name_and_its_error():
    assert catalog.parse_profile_name("MIG 1g.18gb+me") == (1, 18, True)
    with pytest.raises(CatalogError, match=r"expected e\.g\. '1g\.18gb'"):
        catalog.parse_profile_name("big")


def test_ids_and_enums_differ_and_are_the_same_on_all_eight_slice_gpus():
    for key in ("a100-40gb", "a100-80gb", "h100", "h100-nvl", "gh200", "h200", "b200"):
        m = catalog.model(key)
        ids = {p.enum_index: p.profile_id for p in m.profiles}
        assert ids == {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}, key


def test_a30_profile_table():
    a30 = catalog.model("a30")
    assert a30.memory_slices == 4
    assert a30.profile("2g.12gb+me").profile_id == 6
    assert a30.profile_by_enum(catalog.GI_PROFILE_4_SLICE).name == "4g.24gb"


@pytest.mark.parametrize(
    ("slices", "start", "size", "gi"),
    [(8, 0, 8, 0), (8, 0, 4, 1), (8, 4, 4, 2), (8, 0, 2, 3), (8, 6, 2, 6), (8, 0, 1, 7),
     (8, 6, 1, 13), (4, 0, 4, 0), (4, 2, 2, 2), (4, 3, 1, 6)],
)
def test_gi_id_follows_placement(slices, start, size, gi):
    assert catalog.gi_id_for_placement(slices, start, size) == gi


def test_misaligned_placement_is_refused():
    with pytest.raises(CatalogError, match="not aligned"):
        catalog.gi_id_for_placement(8, 1, 2)


def test_driver_start_order_without_placement():
    h100 = catalog.model("h100")
    assert h100.driver_starts(h100.profile("1g.10gb")) == (6, 4, 5, 0, 1, 2, 3)
    assert h100.driver_starts(h100.profile("2g.20gb")) == (4, 0, 2)  # 6 is no 2g start
    assert h100.driver_starts(h100.profile("3g.40gb")) == (4, 0)
    assert h100.driver_starts(h100.profile("4g.40gb")) == (0,)


def test_profile_by_id_and_enum_errors_name_the_gpu():
    h200 = catalog.model("h200")
    with pytest.raises(CatalogError, match=r"profile ID 99 .*H200"):
        h200.profile_by_id(99)
    with pytest.raises(CatalogError, match=r"enum 8 .*H200"):
        h200.profile_by_enum(catalog.GI_PROFILE_2_SLICE_REV1)


def test_profiles_fit_their_gpu():
    for m in catalog.MODELS:
        for p in m.profiles:
            assert p.memory_mib < m.memory_mib
            for start in p.placement_starts:
                assert start + p.placement_size <= m.memory_slices
                m.gi_id(start, p.placement_size)  # aligned


def profile_table(model: catalog.GpuModel) -> str:
    """The markdown table docs/gpus.md must contain for ``model`` (kept in step by a test)."""
    lines = [
        f"### {model.display_name} (`{model.key}`)",
        "",
        "| profile | ID | enum | compute slices | memory slices | GiB | SMs | copy engines "
        "| max instances | placement starts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in model.profiles:
        starts = ", ".join(map(str, p.placement_starts))
        lines.append(
            f"| {p.name} | {p.profile_id} | {p.enum_index} | {p.compute_slices} "
            f"| {p.memory_slices} | {p.memory_gib:.2f} | {p.sm_count} | {p.copy_engines} "
            f"| {p.max_instances} | {starts} |"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("gpu_model", catalog.MODELS, ids=lambda m: m.key)
def test_docs_gpus_table_matches_the_catalog(gpu_model):
    docs = (Path(__file__).parent.parent / "docs" / "gpus.md").read_text()
    expected = profile_table(gpu_model)
    assert expected in docs, f"docs/gpus.md is out of date; this table belongs in it:\n{expected}"
