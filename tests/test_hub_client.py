"""The hub REST client: paging, retries, concurrency, timeouts; then against a real hub."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest
import requests
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from mig_spawner.hub.client import (
    IDLE_ADDRESSES,
    PER_SERVER,
    HubClient,
    HubError,
    HubUnavailable,
)
from mig_spawner.hub.models import HubServer, HubUser, Kernel
from mig_spawner.service.app import REQUIRED_SCOPES, missing_scopes
from mig_spawner.spawner.warnings import SINGLEUSER_CONFIG
from tests.support.hub_standin import StandinState, make_app
from tests.support.polling import until, until_async

# -- against the stand-in (scale and injected faults) ---------------------------------


async def all_users(client: HubClient, state: str | None = "active") -> list[HubUser]:
    """Every user matching ``state``, all pages read."""
    return [user async for user in client.iter_users(state)]


@pytest.fixture
async def standin(serve_hub):
    state = StandinState.build(1234, kernels_per_server=2)
    return state, serve_hub(state)


def client_for(base: str, **kw) -> HubClient:
    kw.setdefault("backoff_base", 0.01)
    return HubClient(f"{base}/hub/api", "secret", proxy_url=base, **kw)


async def test_pagination_follows_next_until_every_user_is_read(standin):
    state, base = standin
    client = client_for(base)
    users = await all_users(client, state="ready")
    assert [u.name for u in users] == sorted(state.users)  # each once, in order
    assert state.requests[("GET", "users")] == 25  # 1234 users / 50 per page
    server = users[7].servers[0]
    assert (server.user, server.name, server.ready) == ("user00007", "", True)
    assert server.last_activity is not None and server.last_activity.tzinfo is not None


async def test_page_size_is_sent_and_capped_by_the_hub(standin):
    state, base = standin
    users = await all_users(client_for(base, page_size=500))
    assert len(users) == 1234
    assert state.requests[("GET", "users")] == 7  # the hub caps a page at 200


async def test_503_is_retried_with_backoff_then_succeeds(standin):
    state, base = standin
    state.fail_next = 3
    began = time.monotonic()
    users = await all_users(client_for(base, retries=4, backoff_base=0.05))
    assert len(users) == 1234
    # 0.05 + 0.1 + 0.2 s of backoff before the first page came through
    assert time.monotonic() - began >= 0.35
    assert state.requests[("GET", "users")] == 25 + 3


async def test_retries_exhausted_raise_hub_unavailable_naming_the_call(standin):
    state, base = standin
    state.fail_next = 100
    with pytest.raises(HubUnavailable) as err:
        await client_for(base, retries=2).version()
    assert err.value.code == 503
    assert "GET http://127.0.0.1" in str(err.value) and "hub is busy" in str(err.value)
    assert state.requests[("GET", "")] == 3


async def test_client_errors_are_not_retried(standin):
    state, base = standin
    state.fail_next, state.fail_code = 1, 403
    with pytest.raises(HubError) as err:
        await client_for(base).version()
    assert not isinstance(err.value, HubUnavailable)
    assert err.value.code == 403
    assert state.requests[("GET", "")] == 1


async def test_connection_refused_is_retried_then_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(HubUnavailable) as err:
        await client_for(f"http://127.0.0.1:{port}", retries=2).version()
    assert err.value.code == 599


async def test_slow_hub_times_out_and_is_reported(standin):
    state, base = standin
    state.delay = 1.0
    with pytest.raises(HubUnavailable) as err:
        await client_for(base, retries=1, request_timeout=0.2).version()
    assert err.value.code == 599
    assert "Timeout" in err.value.reason


async def test_concurrency_is_bounded(standin):
    state, base = standin
    state.delay = 0.02
    client = client_for(base, concurrency=4)
    users = await all_users(client)
    servers = [s for u in users[:40] for s in u.servers]
    await asyncio.gather(*(client.kernels(s) for s in servers))
    assert state.max_in_flight == 4


async def test_stop_server_and_kernels_through_the_proxy(standin):
    state, base = standin
    client = client_for(base)
    [user] = [u for u in await all_users(client) if u.name == "user00003"]
    server = user.servers[0]
    kernels = await client.kernels(server)
    assert [k.id for k in kernels] == ["user00003-k0", "user00003-k1"]
    await client.shutdown_kernel(server, "user00003-k0")
    await client.shutdown_kernel(server, "user00003-k0")  # already gone: fine
    assert [k.id for k in await client.kernels(server)] == ["user00003-k1"]
    assert await client.stop_server("user00003") is True
    assert state.stopped == ["user00003/"]
    assert await client.stop_server("nobody") is True  # an unknown user counts as stopped


class CountingServer(HTTPServer):
    """The stand-in, counting the connections clients open to it."""

    opened = 0

    def handle_stream(self, stream, address):
        type(self).opened += 1
        super().handle_stream(stream, address)


@pytest.fixture
def counted():
    """Serves stand-in states on localhost ports, counting the connections opened to
    all of them (``CountingServer.opened``) and those open now (``.open_now()``)."""
    servers = []
    CountingServer.opened = 0

    def serve(state: StandinState) -> str:
        server = CountingServer(make_app(state))
        [sock] = bind_sockets(0, "127.0.0.1")[:1]
        server.add_sockets([sock])
        servers.append(server)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    serve.open_now = lambda: sum(len(s._connections) for s in servers)
    yield serve
    for server in servers:
        server.stop()


async def test_requests_share_kept_alive_connections(counted):
    """Reading 40 servers' kernels and shutting their idle kernels down opens no more
    connections than requests run at once, not one per request."""
    state = StandinState.build(40, kernels_per_server=2)
    base = counted(state)
    client = client_for(base, concurrency=4)
    servers = [s for u in await all_users(client) for s in u.servers]

    async def sweep_one(server):
        for kernel in await client.kernels(server):
            await client.shutdown_kernel(server, kernel.id)

    await asyncio.gather(*(sweep_one(s) for s in servers))
    assert not any(state.kernels.values())  # 121 requests in all...
    # ...on at most one connection per request at once, and the hub's API on its own.
    assert CountingServer.opened <= 4 + 1
    await client.close()


async def test_one_server_gets_at_most_two_requests_at_once(standin):
    state, base = standin
    state.delay = 0.05
    client = client_for(base, concurrency=8)
    [user] = [u for u in await all_users(client) if u.name == "user00003"]
    server = user.servers[0]
    await asyncio.gather(*(client.kernels(server) for _ in range(10)))
    assert state.max_in_flight == PER_SERVER == 2
    # Different servers use the concurrency in all.
    state.max_in_flight = 0
    others = [s for u in (await all_users(client))[:16] for s in u.servers]
    await asyncio.gather(*(client.kernels(s) for s in others))
    assert state.max_in_flight == 8


async def test_connections_kept_for_later_are_few_whatever_the_servers(counted):
    """A sweep reaches each server at its own address: the connections kept open for a
    next request are those of the few addresses used last, not of every server."""
    state = StandinState.build(30, kernels_per_server=1)
    bases = [counted(state) for _ in range(30)]  # 30 addresses
    client = client_for(bases[0], concurrency=2)
    servers = [replace(s, full_url=f"{bases[i]}{s.url}")
               for i, u in enumerate(await all_users(client)) for s in u.servers]
    for server in servers:
        await client.kernels(server)
    assert CountingServer.opened >= 30
    bound = IDLE_ADDRESSES * 2 + 1  # the hub's API too
    # The servers see the closes a moment after the client.
    await until_async(lambda: counted.open_now() <= bound, 10,
                      f"at most {bound} connections open", show=counted.open_now, every=0.05)
    await client.close()


class Answers:
    """A server at a localhost port that answers each request on a connection with the
    next of ``answers`` (raw bytes, as some servers and proxies write them), counting the
    connections opened; ``then_close``: it closes the connection after each answer,
    without saying so (as an idle timeout does)."""

    def __init__(self, answers: list[bytes], then_close: bool = False) -> None:
        self.answers, self.then_close, self.opened = answers, then_close, 0

    async def serve(self, reader, writer) -> None:
        self.opened += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                await reader.readexactly(length[0] if length else 0)
                writer.write(self.answers.pop(0))
                await writer.drain()
                if self.then_close or not self.answers:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/user/ana/"


async def test_answers_whole_however_the_server_frames_them():
    """Chunked (with a chunk extension and a trailer), to the end of the connection (an
    HTTP/1.0 answer), an empty 204: each body is read whole, and a connection is kept only
    where the answer allows it."""
    chunks = [b'[{"id"', b': "k1", "name": "python3"}]']
    answers = Answers([
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks)
        + b"0\r\nX-Trailer: y\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n[]",
    ])
    base = await answers.start()
    client = client_for(base)
    server = HubServer("ana", "", "/user/ana/", base, True, None, None, None)
    assert [k.id for k in await client.kernels(server)] == ["k1"]
    await client.shutdown_kernel(server, "k1")  # 204, on the same connection
    assert await client.kernels(server) == []  # read to the end of the connection
    assert answers.opened == 1
    await client.close()
    answers.server.close()


async def test_a_kept_connection_the_server_closed_is_replaced_without_an_error():
    answers = Answers([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]"] * 2,
                      then_close=True)
    base = await answers.start()
    client = client_for(base, retries=0)
    server = HubServer("ana", "", "/user/ana/", base, True, None, None, None)
    assert await client.kernels(server) == []
    assert await client.kernels(server) == []  # its kept connection was closed meanwhile
    assert answers.opened == 2
    await client.close()
    answers.server.close()


def test_server_without_any_url_to_reach_it_says_what_to_set():
    client = HubClient("http://127.0.0.1:1/hub/api", "t")
    server = HubServer("ana", "", "/user/ana/", None, True, None, None, None)
    with pytest.raises(HubError, match=r"JupyterHub\.public_url"):
        client.server_url(server)
    full = HubServer("ana", "x", "/user/ana/x/", "http://hub.example/user/ana/x", True,
                     None, None, None)
    assert client.server_url(full) == "http://hub.example/user/ana/x/"
    # The internal address a lease records wins: reads through the proxy count as activity.
    assert client.server_url(full, "http://10.0.0.7:41000/user/ana/x/") == (
        "http://10.0.0.7:41000/user/ana/x/")


# -- against a real JupyterHub ------------------------------------------------------



@pytest.fixture(scope="module")
def real_hub(tmp_path_factory):
    from tests.support.hub_harness import HubProcess

    workdir = tmp_path_factory.mktemp("hub")
    token = "slice-service-test-token-0123456789"
    hub = HubProcess.start(workdir, extra_config=f"""
        c.JupyterHub.api_page_default_limit = 20
        c.JupyterHub.spawner_class = "simple"
        c.SimpleLocalProcessSpawner.home_dir_template = "{workdir}/home/{{username}}"
        # mig-spawner's single-user extension, as the MIG spawner enables it.
        c.Spawner.environment = {{"JUPYTER_CONFIG_PATH": "{SINGLEUSER_CONFIG}"}}
        c.JupyterHub.services.append({{"name": "slices", "api_token": "{token}"}})
        c.JupyterHub.load_roles.append(
            {{"name": "slices", "services": ["slices"], "scopes": {list(REQUIRED_SCOPES)!r}}})
    """)
    hub.service_token = token
    hub.request("POST", "/users", json={"usernames": [f"u{i:03}" for i in range(75)]})
    hub.add_to_group("analysts", ["u001", "u002"])
    yield hub
    hub.close()


@pytest.mark.hub
async def test_real_hub_pagination_and_groups(real_hub):
    client = HubClient(real_hub.api(""), real_hub.service_token, proxy_url=real_hub.url)
    users = await all_users(client, state=None)
    names = [u.name for u in users]
    assert len(names) == len(set(names)) and {f"u{i:03}" for i in range(75)} <= set(names)
    assert {u.name: u.groups for u in users}["u001"] == ("analysts",)
    assert await all_users(client, state="ready") == []
    assert (await client.version()).startswith(("5.", "6."))
    # The documented scopes are what the hub grants, and all the service checks for.
    assert missing_scopes(await client.token_scopes()) == []
    harness = HubClient(real_hub.api(""), real_hub.token)  # an admin, all scopes
    assert missing_scopes(await harness.token_scopes()) == []


@pytest.mark.hub
async def test_real_hub_kernels_status_and_stop_with_culler_scopes(real_hub):
    real_hub.create_user("kay")
    assert real_hub.spawn("kay").status_code in (201, 202)
    real_hub.wait_ready("kay")
    client = HubClient(real_hub.api(""), real_hub.service_token, proxy_url=real_hub.url)
    [user] = await all_users(client, state="ready")
    server = user.servers[0]
    assert server.started is not None

    assert await client.kernels(server) == []
    real_hub.session.post(f"{real_hub.url}/user/kay/api/kernels", json={"name": "python3"},
                          timeout=30).raise_for_status()
    [kernel] = await client.kernels(server)
    status = await client.server_status(server)
    assert status.kernels == 1 and status.last_activity is not None

    await client.shutdown_kernel(server, kernel.id)
    assert await client.kernels(server) == []
    assert await client.stop_server("kay") in (True, False)
    until(lambda: real_hub.server_model("kay") is None, 30, "kay's server stopped",
          show=real_hub.log_path)
    assert await all_users(client, state="active") == []


@pytest.mark.hub
async def test_real_server_reads_and_culls_in_one_request_each_for_the_service_only(
        real_hub):
    """mig-spawner's single-user extension answers the service's look (kernels, status,
    what people did) and shuts a list of kernels down in one request, each only if it
    is as the service saw it; nobody else may call either, the server's owner neither."""
    real_hub.create_user("lee")
    assert real_hub.spawn("lee").status_code in (201, 202)
    real_hub.wait_ready("lee")
    client = HubClient(real_hub.api(""), real_hub.service_token, proxy_url=real_hub.url)
    [server] = [s for u in await all_users(client, state="ready") if u.name == "lee"
                for s in u.servers]
    empty = await client.look(server)
    assert empty.kernels == () and empty.status.kernels == 0
    assert empty.status.started is not None and empty.people.page_seen is None

    kernels = {}
    for name in ("idle", "used"):
        r = real_hub.session.post(f"{real_hub.url}/user/lee/api/kernels",
                                  json={"name": "python3"}, timeout=60)
        r.raise_for_status()
        kernels[name] = r.json()["id"]
        real_hub.greet_kernel("lee", kernels[name])  # booted: no more messages of its own

    async def settled():
        """A look at two booted kernels whose activity no longer moves."""
        first, second = await client.look(server), await client.look(server)
        return second if first.kernels == second.kernels else None

    seen = {k.id: k for k in (await until_async(settled, 60, "the kernels settled")).kernels}
    # Someone runs a cell in one of them after the service looked.
    real_hub.run_on_kernel("lee", kernels["used"], "1 + 1")
    forged = Kernel(id="f" * 36, name="python3", execution_state="idle",
                    last_activity=seen[kernels["idle"]].last_activity, connections=0)
    answer = await client.shutdown_kernels(
        server, [seen[kernels["idle"]], seen[kernels["used"]], forged],
        cull_busy=False, cull_connected=False)
    assert answer.shut_down == (kernels["idle"],)
    assert answer.kept == (kernels["used"],)
    assert answer.unknown == (forged.id,) and answer.failed == ()
    assert [k.id for k in (await client.look(server)).kernels] == [kernels["used"]]

    # Neither the owner's token nor a request without one gets anything.
    base = f"{real_hub.url}/user/lee/mig-spawner/"
    cull = {"kernels": [{"id": kernels["used"], "last_activity": None}]}
    for headers in ({}, {"Authorization": f"token {real_hub.user_token('lee')}"}):
        for method, path in (("GET", "probe"), ("POST", "cull")):
            r = requests.request(method, base + path, headers=headers, json=cull,
                                 allow_redirects=False, timeout=30)
            assert r.status_code == 403, (method, path, headers, r.status_code)
    assert [k.id for k in (await client.look(server)).kernels] == [kernels["used"]]
    await client.close()
    real_hub.stop_server("lee")
