"""One ledger for hub and service, and a service private by default, on a real hub.

The hub runs the shipped snippets (10-spawner.py, 20-groups.py, 30-slice-service.py)
with the PostgreSQL line exactly as docs/ledger.md gives it, and the shipped managed
slice service beside it; the start-up check runs as in the shipped
jupyterhub_config.py. A server's lease must be in that one PostgreSQL database and be
what the service reports; anonymous and non-admin requests to every route of the
service get nothing of it.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import requests

from mig_spawner.ledger import Ledger
from mig_spawner.observe.slicemap import slicemap_routes
from mig_spawner.service.handlers import METRICS_SCOPE, make_web_app
from mig_spawner.service.metrics import ServiceMetrics
from tests.support.hub_harness import ADMIN_SERVICE, REPO, HubProcess, free_port, simulated_spawner
from tests.support.polling import until

pytestmark = [pytest.mark.hub, pytest.mark.postgres]

SERVICE = "mig-slices"
SNIPPETS = ("10-spawner.py", "20-groups.py", "30-slice-service.py")


def docs_postgres_line() -> str:
    """The line docs/ledger.md tells an admin to put in 10-spawner.py."""
    text = (REPO / "docs" / "ledger.md").read_text()
    return next(line for line in text.splitlines()
                if re.match(r'c\.\w+\.ledger_url = "postgresql', line))


@pytest.fixture(scope="module")
def world(tmp_path_factory, postgres_server):
    workdir = tmp_path_factory.mktemp("sharedledger")
    postgres_server.psql("CREATE DATABASE shared_ledger")
    url = postgres_server.url("shared_ledger")
    config_d = workdir / "jupyterhub_config.d"
    config_d.mkdir()
    for name in SNIPPETS:
        (config_d / name).write_text((REPO / "jupyterhub_config.d" / name).read_text())
    # The admin follows docs/ledger.md: its line, with this test's database in it.
    line = re.sub(r'"postgresql[^"]*"', repr(url).replace("'", '"'), docs_postgres_line())
    spawner = config_d / "10-spawner.py"
    assert 'c.MIGSettings.ledger_url = ""' in spawner.read_text()
    spawner.write_text(spawner.read_text().replace('c.MIGSettings.ledger_url = ""', line))
    (config_d / "90-test.py").write_text(textwrap.dedent(f"""
        c = get_config()  # noqa: F821
{textwrap.indent(simulated_spawner(workdir, "h200x1:layout=1g.18gb*7"), ' ' * 8)}
        c.JupyterHub.load_groups = {{"analysts": {{"users": ["ana", "ben"]}}}}
    """))
    hub = HubProcess.start(workdir, sorted(config_d.glob("*.py")), textwrap.dedent(f"""
        # The harness's token reads the metrics, as Prometheus's would (operations.md).
        c.JupyterHub.load_roles.append({{"name": "scrapers", "scopes": ["{METRICS_SCOPE}"],
                                         "services": ["{ADMIN_SERVICE}"]}})
        from mig_spawner.cli.demo import point_service  # off the fixed port 10101
        point_service(c, "{SERVICE}", "http://127.0.0.1:{free_port()}", "{config_d}")
        from mig_spawner.spawner.startup import check_hub_config
        check_hub_config(c)
    """), timeout=120)
    base = f"{hub.url}/services/{SERVICE}"
    until(lambda: requests.get(f"{base}/health", timeout=5).ok, 60, "the service up",
          show=hub.log_path)
    r = hub.spawn("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    yield hub, url, base
    hub.close()


def test_the_docs_postgresql_setup_puts_hub_and_service_on_one_ledger(world):
    hub, url, base = world
    with Ledger.open(url) as ledger:
        lease = ledger.leases.active_for_server("ana")
    assert lease is not None and lease.mig_uuid
    assert not (hub.workdir / "mig_spawner_ledger.sqlite").exists()  # no second ledger
    # The service reads the same database: it reports ana's slice.
    metrics = hub.session.get(f"{base}/metrics", timeout=10).text
    info = [x for x in metrics.splitlines() if x.startswith("mig_spawner_slice_info{")
            and 'user="ana"' in x]
    assert len(info) == 1 and f'mig_uuid="{lease.mig_uuid}"' in info[0], metrics[-3000:]


def service_paths(prefix: str) -> list[str]:
    """Every route the slice service serves (its own app, as app.py builds it)."""
    app = make_web_app(prefix, ServiceMetrics(), dict,
                       slicemap_routes(prefix, snapshot=lambda: None))
    return [rule.matcher.regex.pattern.rstrip("$") for rule in app.wildcard_router.rules]


def test_no_route_of_the_service_shows_leases_to_anonymous_or_non_admin_users(world):
    hub, url, _ = world
    prefix = f"/services/{SERVICE}/"
    paths = [p for p in service_paths(prefix)
             if p.startswith(prefix) and not p.endswith("oauth_callback")]
    assert {prefix + "metrics", prefix + "health", prefix + "slices.json"} <= set(paths)
    ben = {"Authorization": f"Bearer {hub.user_token('ben')}"}  # a user, not an admin
    with Ledger.open(url) as ledger:
        private = ("ana", ledger.leases.active_for_server("ana").mig_uuid)
    for path in paths:
        for who, headers in (("anonymous", {}), ("ben", ben)):
            r = requests.get(hub.url + path, headers=headers, timeout=10,
                             allow_redirects=False)
            where = f"{who} GET {path}: {r.status_code}"
            assert not any(word in r.text for word in private), where
            if path.endswith("/health"):
                assert r.json() == {"status": "ok"}, where
            elif path == prefix:  # the hub's Services menu link: on to the map
                assert r.status_code == 301 and r.headers["Location"].endswith("slices")
            elif r.status_code == 302:  # a browser without a session: to the hub's login
                assert who == "anonymous" and "/hub/" in r.headers["Location"], where
            else:
                assert r.status_code in (401, 403), where
