"""The slice map's data, templates and routes, without a hub (the OAuth path runs against a
real hub in browser/test_slicemap.py)."""

from __future__ import annotations

import json

import pytest
from tornado.httputil import HTTPHeaders, HTTPServerRequest, RequestStartLine
from tornado.web import Application

from mig_spawner.core.health import Fault, FaultKind, xid_words
from mig_spawner.ledger import FaultHold
from mig_spawner.observe import slicemap
from mig_spawner.observe.slice_state import GroupRow, slice_map
from tests.support.observe_world import make_world

HOSTILE = "</script><script>alert(1)</script>"


@pytest.fixture
def world(tmp_path):
    w = make_world(tmp_path)
    yield w
    w.close()


def test_json_has_every_gpu_slice_and_group(world):
    world.lease("ada", "research", world.device(0, "3g.71gb"), server="llm")
    world.clock.advance(minutes=90)
    data = slicemap.slicemap_json(
        slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now, world.policy))
    json.dumps(data)  # all of it serialisable
    assert data["counts"] == {"free": 7, "leased": 0, "idle": 1, "orphan": 0}
    gpu0 = data["gpus"][0]
    assert gpu0["memory_slices"] == 8 and gpu0["free_memory_slices"] == []
    ada = next(s for s in gpu0["slices"] if s["user"] == "ada")
    assert (ada["server"], ada["state"], ada["start"], ada["size"]) == ("ada/llm", "idle", 4, 4)
    assert {g["name"] for g in data["groups"]} == {"analysts", "research"}


def test_hostile_names_cannot_break_out_of_the_page(world):
    world.lease(HOSTILE, "research", world.device(1, "1g.18gb"))
    view = slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now, world.policy)
    page = slicemap._LOADER.load("slicemap.html").generate(
        data_json=slicemap._script_json(slicemap.slicemap_json(view)), refresh=5,
        user=None, json_url="slices.json", table_url="slices/table",
        states=("free", "leased", "idle", "orphan"), xsrf="x").decode()
    assert HOSTILE not in page
    assert json.loads(page.split('type="application/json">')[1].split("</script>")[0])[
        "gpus"][1]["slices"][0]["user"] == HOSTILE
    table = slicemap._LOADER.load("slicetable.html").generate(
        view=view, refresh=5, human=slicemap.human_seconds, user=None,
        map_url="../slices", nodes=None).decode()
    assert HOSTILE not in table and "&lt;/script&gt;" in table


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "-"), (42, "42s"), (7 * 60 + 5, "7m"), (2 * 3600 + 5 * 60, "2h 05m"),
    (3 * 86400 + 4 * 3600, "3d 4h"),
])
def test_human_seconds(seconds, text):
    assert slicemap.human_seconds(seconds) == text


def test_routes_live_under_the_service_prefix():
    app = Application(slicemap.slicemap_routes("/services/mig-slice-service", lambda: None))

    def handler(path: str) -> type:
        request = HTTPServerRequest(start_line=RequestStartLine("GET", path, "HTTP/1.0"),
                                    headers=HTTPHeaders())
        return app.find_handler(request).handler_class

    root = "/services/mig-slice-service/"
    assert handler(root + "slices") is slicemap.SliceMapPage
    assert handler(root + "slices/table") is slicemap.SliceTablePage
    assert handler(root + "slices.json") is slicemap.SliceMapJson
    assert handler(root + "oauth_callback").__name__ == "HubOAuthCallbackHandler"
    with pytest.raises(ValueError, match="refresh_seconds"):
        slicemap.slicemap_routes("/", lambda: None, refresh_seconds=0)



# --- one memory display: GiB with one decimal beside the profile name --------------------

SHOWN = {"1g.18gb": "16.0 GiB", "1g.35gb": "32.2 GiB", "2g.35gb": "32.2 GiB",
         "3g.71gb": "69.5 GiB", "7g.141gb": "139.8 GiB"}


def _h200_every_size(tmp_path):
    return make_world(tmp_path, "h200x1:layout=1g.18gb,1g.35gb,3g.71gb"
                                "+h200x1:layout=2g.35gb+h200x1:layout=7g.141gb")


def test_slice_map_json_and_table_show_gib_beside_the_profile(tmp_path):
    world = _h200_every_size(tmp_path)
    try:
        view = slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now,
                         world.policy)
        rows = [s for g in slicemap.slicemap_json(view)["gpus"] for s in g["slices"]]
        assert {r["profile"]: r["memory_total_text"] for r in rows} == SHOWN
        assert all(r["memory_text"].startswith("0.0 GiB / ") for r in rows)
        table = slicemap._LOADER.load("slicetable.html").generate(
            view=view, refresh=10, human=slicemap.human_seconds, user={"name": "a"},
            map_url="../slices", nodes=None).decode()
        assert "0.0 GiB / 139.8 GiB" in table and "0.0 GiB / 32.2 GiB" in table
    finally:
        world.close()


@pytest.mark.browser
def test_slice_map_page_draws_gib_beside_the_profile_in_chromium(tmp_path):
    pytest.importorskip("playwright.sync_api")
    from tests.support.browser import launch_chromium
    from tests.support.system_deps import require_chromium

    require_chromium()
    world = _h200_every_size(tmp_path)
    try:
        view = slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now,
                         world.policy)
        page_html = slicemap._LOADER.load("slicemap.html").generate(
            data_json=slicemap._script_json(slicemap.slicemap_json(view)), refresh=3600,
            user={"name": "admin"}, json_url="slices.json", table_url="slices/table",
            states=slicemap.SLICE_STATES, xsrf="x").decode()
    finally:
        world.close()
    with launch_chromium() as browser:
        page = browser.new_page()
        page.set_content(page_html)
        labels = page.locator(".slice .profile").all_inner_texts()
    assert sorted(labels) == sorted(f"{name} · {gib} · free" for name, gib in SHOWN.items())


# --- a GPU fault: its slices in a colour of their own, with the reason ---------------------

def _fault_page(tmp_path):
    """The map of a host where a contained ECC error (Xid 94) withholds one 1g.18gb of GPU
    0, which ada holds, and GPU 1 is withheld whole for uncorrectable ECC errors."""
    world = make_world(tmp_path)
    try:
        device = world.device(0, "1g.18gb")
        world.lease("ada", "research", device)
        inventory = world.inventory()
        gpu1 = inventory.gpus[1]
        world.ledger.holds.record_faults(inventory.host, [
            FaultHold(Fault(FaultKind.XID, 0, device.gpu_uuid, xid_words(94),
                            gi_id=device.gi_id, ci_id=device.ci_id, xid=94),
                      frozenset(range(device.start, device.start + device.size)), 8),
            FaultHold(Fault(FaultKind.ECC, 1, gpu1.uuid, "2 uncorrectable ECC memory "
                            "error(s) since the GPU was last reset"), None, 8)])
        view = slice_map(inventory, world.ledger.leases.active(), world.clock.now,
                         world.policy, faults=world.ledger.holds.faults())
    finally:
        world.close()
    return view, device


def test_the_map_names_the_fault_of_each_withheld_slice(tmp_path):
    view, device = _fault_page(tmp_path)
    data = slicemap.slicemap_json(view)
    rows = {r["mig_uuid"]: r for g in data["gpus"] for r in g["slices"]}
    assert rows[device.uuid]["fault"] == ("GPU 0 reported a hardware fault: Xid 94 "
                                          "(contained ECC error)")
    assert rows[device.uuid]["user"] == "ada"  # still hers: the fault does not end it
    gpu0, gpu1 = data["gpus"]
    assert [r["fault"] is not None for r in gpu0["slices"]].count(True) == 1
    assert all("uncorrectable ECC" in r["fault"] for r in gpu1["slices"])
    assert gpu1["faulty_slices"] == list(range(8))


@pytest.mark.browser
def test_the_map_draws_faulty_slices_in_their_own_colour_in_chromium(tmp_path):
    pytest.importorskip("playwright.sync_api")
    from tests.support.browser import launch_chromium
    from tests.support.system_deps import require_chromium

    require_chromium()
    view, _ = _fault_page(tmp_path)
    page_html = slicemap._LOADER.load("slicemap.html").generate(
        data_json=slicemap._script_json(slicemap.slicemap_json(view)), refresh=3600,
        user={"name": "admin"}, json_url="slices.json", table_url="slices/table",
        states=slicemap.SLICE_STATES, xsrf="x").decode()
    with launch_chromium() as browser:
        page = browser.new_page()
        page.set_content(page_html)
        faulty = page.locator(".slice.faulty")
        leased = page.locator(".slice.state-leased:not(.faulty), .slice.state-free:not(.faulty)")
        colour = faulty.first.evaluate("e => getComputedStyle(e).backgroundColor")
        others = set(leased.evaluate_all(
            "es => es.map(e => getComputedStyle(e).backgroundColor)"))
        texts = faulty.all_inner_texts()
        headers = page.locator(".gpu .fault").all_inner_texts()
    assert colour not in others and len(others) >= 1
    assert any("ada" in t and "Xid 94 (contained ECC error)" in t for t in texts)
    assert headers[0].startswith("Withheld: GPU 0 reported a hardware fault")


@pytest.mark.parametrize(("used", "budget", "over"), [
    (39.9, 40.0, False), (40.0, 40.0, True), (41.0, 40.0, True), (None, None, False),
    (3.0, None, False)])
def test_a_group_that_used_its_whole_budget_is_marked_over(used, budget, over):
    """The table view marks it as the map's script does (used at or past the budget)."""
    row = GroupRow("analysts", 1, 1, None, None, True, budget_used_hours=used,
                   budget_hours=budget, budget_text="x")
    assert row.over_budget is over
