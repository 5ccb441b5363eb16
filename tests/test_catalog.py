"""The MIG catalog: lookups, placement rules and the errors a user sees for bad names."""

from __future__ import annotations

from dataclasses import replace
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
    assert catalog.parse_profile_name("MIG 1g.18gb+me") == (1, 18, "+me")
    with pytest.raises(CatalogError, match=r"expected e\.g\. '1g\.18gb'"):
        catalog.parse_profile_name("big")


@pytest.mark.parametrize(("name", "variant"), [
    ("1g.24gb", ""), ("1g.24gb+me", "+me"), ("1g.24gb+me.all", "+me.all"),
    ("1g.24gb-me", "-me"), ("MIG 1g.24gb+gfx", "+gfx"), ("4g.96gb+gfx", "+gfx"),
])
def test_profile_grammar_accepts_every_nvidia_suffix(name, variant):
    assert catalog.parse_profile_name(name)[2] == variant
    rtx = catalog.model("rtx-pro-6000")
    assert rtx.profile(name).variant == variant


@pytest.mark.parametrize("name", ["1g.24gb+mee", "1g.24gb+me.al", "1g.24gb+GFXX", "1g.24gb-gfx"])
def test_unknown_suffix_is_refused_with_the_valid_names(name):
    with pytest.raises(CatalogError, match="not a MIG profile name"):
        catalog.parse_profile_name(name)
    with pytest.raises(CatalogError) as exc:
        catalog.model("rtx-pro-6000").profile(name)
    assert "1g.24gb+me.all" in str(exc.value) and "4g.96gb+gfx" in str(exc.value)


def test_h200_rows_equal_the_real_driver_output():
    """NVIDIA/mig-parted#120's -lgip and the guide's H200 table."""
    h200 = catalog.model("h200")
    got = {p.name: (p.memory_gib, p.sm_count, p.copy_engines) for p in h200.profiles}
    assert got == {
        "1g.18gb": (16.00, 16, 1), "1g.18gb+me": (16.00, 16, 1), "1g.35gb": (32.25, 26, 1),
        "2g.35gb": (32.25, 32, 2), "3g.71gb": (69.50, 60, 3), "4g.71gb": (69.50, 64, 4),
        "7g.141gb": (139.75, 132, 8),
    }
    assert all(p.verified for p in h200.profiles)


def test_b200_rows_equal_the_real_driver_output():
    """NVIDIA/mig-parted#166/#187, gpu-operator#1242: SMs, copy engines, R570 memory."""
    b200 = catalog.model("b200")
    got = {p.name: (p.sm_count, p.copy_engines) for p in b200.profiles}
    assert {k: got[k] for k in ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb")} == {
        "1g.23gb": (18, 2), "1g.23gb+me": (18, 2), "1g.45gb": (30, 2), "2g.45gb": (36, 4)}
    assert [got[k][1] for k in ("3g.90gb", "4g.90gb", "7g.180gb")] == [6, 8, 16]
    assert b200.profile("1g.23gb").memory_gib == 22.00
    assert b200.profile("1g.45gb").memory_gib == 44.25
    assert not b200.profile("7g.180gb").verified  # SMs and GiB of the big ones: estimates


@pytest.mark.parametrize(("mib", "text"), [
    (16384, "16.0 GiB"), (33024, "32.2 GiB"), (71168, "69.5 GiB"), (143104, "139.8 GiB"),
    (0, "0.0 GiB"), (1024 * 22.5, "22.5 GiB"), (1024 * 20.25, "20.2 GiB"),
])
def test_format_gib_rounds_half_to_even_on_the_exact_value(mib, text):
    assert catalog.format_gib(mib) == text


@pytest.mark.parametrize(("printed", "mib"), [
    (19.62, 20096), (21.62, 22144), (46.38, 47488), (5.81, 5952), (23.62, 24192),
    (9.75, 9984), (19.50, 19968), (47.38, 48512), (95.12, 97408),
])
def test_memory_is_the_drivers_exact_mib_not_the_printed_gib_times_1024(printed, mib):
    """Real MIG devices: 9984 MiB (H100 PCIe 1g.10gb), 19968 (A100 80GB 2g.20gb), 24192
    (RTX PRO 6000 1g.24gb): 64 MiB steps, which nvidia-smi's two decimals pin down."""
    assert catalog.printed_mib(printed) == mib
    assert f"{mib / 1024:.2f}" == f"{printed:.2f}"


def test_h200_shows_the_acceptance_figures():
    shown = [p.memory_text for p in catalog.model("h200").profiles]
    assert shown == ["16.0 GiB", "16.0 GiB", "32.2 GiB", "32.2 GiB", "69.5 GiB", "69.5 GiB",
                     "139.8 GiB"]


@pytest.mark.parametrize(("product", "key"), [
    ("A100-SXM4-40GB", "a100-40gb"), ("H100 80GB HBM3", "h100"), ("NVIDIA  H200", "h200"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"), ("NVIDIA B200", "b200"),
])
def test_product_names_without_the_nvidia_prefix(product, key):
    assert catalog.model_for_product(product).key == key


def test_a30_default_placement_order_as_a_real_driver_does():
    """535.183.01: the first 1g at start 0, the next at 1, then a 2g at 2."""
    a30 = catalog.model("a30")
    assert a30.driver_starts(a30.profile("1g.6gb")) == (0, 1, 2, 3)
    assert a30.driver_starts(a30.profile("2g.12gb")) == (0, 2)


def test_driver_figures_win_and_the_catalog_is_the_fallback():
    h200 = catalog.model("h200")
    driver = [replace(h200.profile("1g.18gb"), memory_mib=17000, sm_count=15)]
    merged = h200.with_driver_figures(driver)
    assert (merged.profile("1g.18gb").memory_mib, merged.profile("1g.18gb").sm_count) == (
        17000, 15)
    assert merged.profile("7g.141gb") == h200.profile("7g.141gb")
    assert h200.with_driver_figures([]) is h200


def test_compare_profiles_names_the_differing_rows():
    h200 = catalog.model("h200")
    driver = [replace(p, memory_mib=p.memory_mib - 512) if p.name == "3g.71gb" else p
              for p in h200.profiles if p.name != "7g.141gb"]
    assert catalog.compare_profiles(h200.profiles, driver) == [
        "3g.71gb: memory_mib catalog 69.5 GiB driver 69.0 GiB",
        "7g.141gb: in the catalog, not reported by the driver",
    ]
    assert catalog.compare_profiles(h200.profiles, h200.profiles) == []


def test_ids_and_enums_differ_and_are_the_same_on_all_eight_slice_gpus():
    for key in (m.key for m in catalog.MODELS if m.memory_slices == 8):
        m = catalog.model(key)
        ids = {p.enum_index: p.profile_id for p in m.profiles}
        assert ids == {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}, key


def test_a30_profile_table():
    a30 = catalog.model("a30")
    assert a30.memory_slices == 4
    assert a30.profile("2g.12gb+me").profile_id == 6
    assert a30.profile_by_enum(catalog.GI_PROFILE_4_SLICE).name == "4g.24gb"


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
                assert start % p.placement_size == 0  # aligned
            assert p.source, f"{m.key} {p.name} names no source"


def profile_table(model: catalog.GpuModel) -> str:
    """The markdown table docs/gpus.md must contain for ``model`` (kept in step by a test)."""
    lines = [
        f"### {model.display_name} (`{model.key}`)",
        "",
        "| profile | ID | enum | compute slices | memory slices | MiB | GiB | SMs "
        "| copy engines | DEC | ENC | JPEG | OFA | max instances | placement starts | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in model.profiles:
        starts = ", ".join(map(str, p.placement_starts))
        source = p.source if p.verified else f"**unverified**: {p.source}"
        media = " | ".join(map(str, p.media))
        lines.append(
            f"| {p.name} | {p.profile_id} | {p.enum_index} | {p.compute_slices} "
            f"| {p.memory_slices} | {p.memory_mib} | {p.memory_gib:.2f} | {p.sm_count} "
            f"| {p.copy_engines} | {media} | {p.max_instances} | {starts} | {source} |"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("gpu_model", catalog.MODELS, ids=lambda m: m.key)
def test_docs_gpus_table_matches_the_catalog(gpu_model):
    docs = (Path(__file__).parent.parent / "docs" / "gpus.md").read_text()
    expected = profile_table(gpu_model)
    assert expected in docs, f"docs/gpus.md is out of date; this table belongs in it:\n{expected}"
