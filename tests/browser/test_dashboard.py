"""The operator dashboard in Debian's Chromium against a running Strata (daphne, a node worker serving
the tiny model, PostgreSQL, Redis): login, real numbers, live changes within 2 s, reconnects, policy
edits that round-trip, invalid edits that change nothing, a viewer who cannot edit, screenshots."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.browser.conftest import BLEND_NAMESPACE, NODE, Api, System, live, now, wait_until
from tests.support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PAGES = {
    "overview": "/",
    "nodes": "/nodes/",
    "blocks": "/blocks/",
    "requests": "/requests/",
    "policies": "/policies/",
    "movements": "/movements/",
}


def _tier(api: Api, tier: str) -> dict[str, Any]:
    node = api.get(f"/api/v1/nodes/{NODE}/")
    return next(t for t in node["tiers"] if t["tier"] == tier)


def _complete(system: System, prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    request = urllib.request.Request(
        system.node_api + "/v1/completions",
        method="POST",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _host_policy(api: Api) -> dict[str, Any]:
    return next(p for p in api.get("/api/v1/tier-policies/")["results"] if p["tier"] == "host" and not p["node_group"])


def _versions(api: Api) -> list[int]:
    return [v["number"] for v in api.get("/api/v1/policy-versions/?page_size=500")["results"]]


def _host_cell(page: Any) -> Any:
    return page.locator(f'#nodes tr[data-node="{NODE}"] td[data-tier="host"]')


def test_login_then_the_overview_shows_the_numbers_of_the_rest_api(system, apis, login, screenshots):
    wait_for(
        lambda: any(n["name"] == NODE for n in apis["viewer"].get("/api/v1/nodes/")["results"]),
        timeout=60,
        what="the node's first heartbeat",
    )
    page = login("admin")
    live(page)
    host = _tier(apis["viewer"], "host")
    cell = _host_cell(page)
    cell.wait_for()
    assert int(cell.get_attribute("data-capacity")) == host["capacity_bytes"] == 64 * 1024**2
    assert int(cell.get_attribute("data-used")) == host["used_bytes"]
    assert page.locator(f'#nodes tr[data-node="{NODE}"] [data-field="state"]').inner_text() == "up"
    assert page.locator('#tier-cards [data-tier="host"]').count() == 1
    assert page.locator("#mode").inner_text() == (apis["viewer"].get("/api/v1/dashboard/overview/")["mode"] or "none")
    # The charting library is served by the control plane itself.
    assert page.evaluate("typeof uPlot") == "function"
    assert page.locator("#chart-occupancy canvas").count() >= 1
    page.screenshot(path=str(screenshots / "overview-1280-light.png"), full_page=True)


def test_a_change_shows_on_the_overview_within_two_seconds(system, apis, login, screenshots):
    page = login("operator")
    live(page)
    before = _tier(apis["viewer"], "host")["used_bytes"]
    answer = _complete(system, "Strata keeps KV blocks in tiers so prompts need not be computed twice. " * 6)
    assert answer["usage"]["prompt_tokens"] > 16
    # The moment the REST API shows the node's new host use, the page has at most 2 s to show it too.

    def changed() -> int | None:
        used = _tier(apis["viewer"], "host")["used_bytes"]
        return used if used != before else None

    after = wait_for(changed, timeout=30, every=0.05, what="the node's heartbeat reporting new host use")
    seen_at = now()
    wait_until(
        page,
        f"""document.querySelector('#nodes tr[data-node="{NODE}"] td[data-tier="host"]')?.dataset.used === '{after}'""",
        timeout=2000,
    )
    assert now() - seen_at < 2.0
    assert page.locator("#events li").count() >= 1
    page.screenshot(path=str(screenshots / "overview-after-change.png"), full_page=True)


def test_the_page_reconverges_to_the_snapshot_after_a_reconnect(system, apis, login):
    page = login("operator")
    live(page)
    resyncs = page.evaluate("Strata.stream.resyncs")
    page.evaluate("Strata.stream.close()")
    # While the socket is down, the mode in force changes.
    status, body = apis["operator"].call("POST", "/api/v1/modes/long-doc/activate/", {"comment": "browser test"})
    assert status == 200, body
    try:
        changed_at = now()
        wait_until(page, "document.querySelector('#mode').textContent === 'long-doc'", timeout=2000 + 1000)
        assert now() - changed_at < 3.0  # reconnect backoff starts at 0.5 s; snapshot then shows it
        wait_until(page, f"Strata.stream.resyncs > {resyncs} && document.body.dataset.streamState === 'live'")
    finally:
        status, body = apis["operator"].call("POST", "/api/v1/modes/long-doc/deactivate/", {"comment": "browser test"})
        assert status == 200, body


def test_a_movement_appears_within_two_seconds(system, apis, login, screenshots):
    _complete(system, "Blocks move between tiers when a tier fills past its high watermark. " * 6)
    wait_for(
        lambda: apis["viewer"].get(f"/api/v1/blocks/?node={NODE}&tier=host")["results"],
        timeout=30,
        what="host blocks of the node in the directory",
    )
    policy = _host_policy(apis["admin"])
    status, body = apis["admin"].call(
        "PATCH",
        f"/api/v1/tier-policies/{policy['id']}/",
        {"capacity_bytes": 1, "comment": "browser test: force a demotion"},
    )
    assert status == 200, body
    try:
        page = login("operator")
        page.goto(system.base + "/movements/")
        live(page)
        last = max((m["id"] for m in apis["viewer"].get("/api/v1/movements/")["results"]), default=0)
        status, plan = apis["operator"].call("POST", "/api/v1/movements/run/", {"node": NODE})
        assert status == 200, plan
        assert plan["moves"] + plan["evictions"] >= 1, plan
        planned_at = now()
        # Only the live stream tells this page about the new movements (the run was not made here).
        wait_until(
            page,
            f"""[...document.querySelectorAll('#history-table tr[data-movement]')]
            .some(row => Number(row.dataset.movement) > {last})""",
            timeout=2000,
        )
        assert now() - planned_at < 2.0
        first = page.locator("#history-table tbody tr[data-movement]").first
        assert "host" in first.inner_text()
        wait_for(
            lambda: apis["viewer"].get("/api/v1/movements/?state=done")["results"],
            timeout=60,
            what=f"the node to finish a movement\n{system.log_tail('node')}",
        )
        page.locator('#history-table tbody tr[data-state="done"]').first.wait_for(timeout=5000)
        page.screenshot(path=str(screenshots / "movements.png"), full_page=True)
    finally:
        status, body = apis["admin"].call(
            "PATCH",
            f"/api/v1/tier-policies/{policy['id']}/",
            {"capacity_bytes": None, "comment": "browser test: restore"},
        )
        assert status == 200, body


def test_a_policy_edit_round_trips(system, apis, login, screenshots):
    page = login("operator")
    page.goto(system.base + "/policies/")
    live(page)
    versions = _versions(apis["viewer"])
    edit = page.get_by_role("button", name="Edit the host policy")
    edit.focus()
    page.keyboard.press("Enter")  # keyboard only
    high = page.get_by_label("High watermark (0–1]")
    assert high.evaluate("el => el === document.activeElement")
    high.fill("0.85")
    page.get_by_label("Comment", exact=True).first.fill("browser: lower the host high watermark")
    page.locator("#tier-form").get_by_role("button", name="Save").click()
    page.locator("#notice .good").wait_for()
    wait_until(
        page,
        'document.querySelector(\'#tier-table tr[data-tier="host"] [data-field="high_watermark"]\')'
        ".textContent === '85%'",
    )
    assert _host_policy(apis["viewer"])["high_watermark"] == pytest.approx(0.85)
    after = _versions(apis["viewer"])
    assert len(after) == len(versions) + 1
    newest = apis["viewer"].get(f"/api/v1/policy-versions/{after[0]}/")
    assert newest["author"] == "operator" and newest["comment"] == "browser: lower the host high watermark"
    page.locator(f'#version-table tr[data-version="{after[0]}"]').wait_for()
    # Its diff shows what changed.
    page.get_by_role("button", name=f"Show what version {after[0]} changed").click()
    page.locator("#diff pre").wait_for()
    assert "high_watermark" in page.locator("#diff pre").inner_text()
    # A dry run previews without moving anything.
    page.get_by_role("button", name="Preview (dry run)").first.click()
    summary = page.locator('[data-field="dry-run-summary"]')
    summary.wait_for()
    assert summary.inner_text().startswith("Would move")
    page.screenshot(path=str(screenshots / "policies-edit.png"), full_page=True)
    # Roll back to the version before: the watermark is what it was.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name=f"Roll back to version {versions[0]}").click()
    wait_until(
        page,
        'document.querySelector(\'#tier-table tr[data-tier="host"] [data-field="high_watermark"]\')'
        ".textContent === '90%'",
    )
    assert _host_policy(apis["viewer"])["high_watermark"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ("0.5", "high_watermark", "low"),  # below the low watermark of 0.75
        ("lots", "high_watermark", "valid number"),
    ],
)
def test_an_invalid_edit_shows_its_error_and_changes_nothing(system, apis, login, screenshots, value, field, message):
    before, versions = _host_policy(apis["viewer"]), _versions(apis["viewer"])
    page = login("operator")
    page.goto(system.base + "/policies/")
    live(page)
    page.get_by_role("button", name="Edit the host policy").click()
    page.get_by_label("High watermark (0–1]").fill(value)
    page.locator("#tier-form").get_by_role("button", name="Save").click()
    error = page.locator("#tier-form .field-error, #tier-form .form-error").filter(has_text=message)
    error.first.wait_for()
    invalid = page.locator('#tier-form [aria-invalid="true"]')
    assert invalid.count() >= 1
    assert field in [invalid.nth(i).get_attribute("name") for i in range(invalid.count())] or value == "0.5"
    assert page.locator("#notice .bad").inner_text().startswith("Not saved")
    assert _host_policy(apis["viewer"]) == before
    assert _versions(apis["viewer"]) == versions
    if value == "0.5":
        page.screenshot(path=str(screenshots / "policies-invalid-edit.png"), full_page=True)


def test_a_viewer_sees_no_edit_controls_and_the_api_refuses_their_writes(system, apis, login, screenshots):
    page = login("viewer")
    live(page)
    for name, path in PAGES.items():
        page.goto(system.base + path)
        assert page.locator("[data-edit]").count() == 0, name
        assert page.get_by_role("button", name="Edit").count() == 0, name
        assert page.get_by_role("button", name="Run migration now").count() == 0, name
    page.goto(system.base + "/policies/")
    live(page)
    page.locator('#tier-table tr[data-tier="host"]').wait_for()
    assert page.get_by_role("button", name="Activate mode long-doc").count() == 0
    page.screenshot(path=str(screenshots / "policies-viewer.png"), full_page=True)
    before = _host_policy(apis["viewer"])
    # The same session, with its CSRF token, straight at the API.
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    refused = page.request.patch(
        f"{system.base}/api/v1/tier-policies/{before['id']}/",
        data={"high_watermark": 0.5},
        headers={"X-CSRFToken": token, "Referer": system.base + "/"},
    )
    assert refused.status == 403
    run = page.request.post(
        f"{system.base}/api/v1/movements/run/", data={}, headers={"X-CSRFToken": token, "Referer": system.base + "/"}
    )
    assert run.status == 403
    assert _host_policy(apis["viewer"]) == before
    # And a write without the CSRF token is refused before any role is considered.
    no_csrf = page.request.patch(f"{system.base}/api/v1/tier-policies/{before['id']}/", data={"high_watermark": 0.5})
    assert no_csrf.status == 403


def test_the_overview_shows_fragment_reuse_as_the_nodes_report_it(system, apis, login, screenshots):
    wait_for(
        lambda: any(n["name"] == NODE for n in apis["viewer"].get("/api/v1/nodes/")["results"]),
        timeout=60,
        what="the node's first heartbeat",
    )
    # A passage stored from one prompt (marked as a segment) and found at another offset of the next.
    passage = [(7 * i) % 250 + 5 for i in range(32)]
    _complete(system, [1, 40, 41, 42, 43, *passage, 9], segments=[[5, 5 + len(passage)]])
    reused = _complete(system, [1, *range(60, 81), *passage, 11])
    assert reused["usage"]["prompt_tokens_details"]["fragment_tokens"] == len(passage)
    stats = apis["viewer"].get("/api/v1/dashboard/cache/")["fragment_reuse"]
    rows = {(r["node"], r["namespace"]): r for r in stats["namespaces"]}
    # The configured namespace is there before any request of its own; the other model's entry is not.
    assert rows[(NODE, BLEND_NAMESPACE)]["recompute_percent"] == 25.0
    assert rows[(NODE, "default")]["recompute_percent"] == 15.0 and not rows[(NODE, "default")]["prefix_only"]
    page = login("viewer")
    expected = f"{int(stats['reused_tokens']['fragment']):,}"
    wait_until(page, f"document.querySelector('#reuse-fragment').textContent === '{expected}'", timeout=10000)
    assert page.locator("#reuse-prefix").inner_text() == f"{int(stats['reused_tokens']['prefix']):,}"
    shown_ratio = page.locator("#reuse-ratio").inner_text()
    assert shown_ratio.endswith("%") and float(shown_ratio[:-1]) == pytest.approx(
        100 * stats["recompute_ratio"], abs=0.05
    )
    row = page.locator(f'#blend-namespaces tr[data-node="{NODE}"][data-namespace="{BLEND_NAMESPACE}"]')
    assert row.locator('[data-field="percent"]').inner_text() == "25%"
    assert row.locator('[data-field="mode"]').inner_text() == "blend"
    default = page.locator(f'#blend-namespaces tr[data-node="{NODE}"][data-namespace="default"]')
    assert default.locator('[data-field="percent"]').inner_text() == "15%"
    assert f"{NODE} (tiny): r 15%" in page.locator("#reuse-nodes").inner_text()
    page.locator("#fragment-reuse").screenshot(path=str(screenshots / "overview-fragment-reuse.png"))


def test_every_page_is_labelled_keyboard_usable_and_readable_light_and_dark(system, apis, login, screenshots):
    # The same prompt twice: the second request loads cached blocks, so it has a per-layer timeline.
    prompt = "A request so that the requests page has a timeline to show. " * 5
    _complete(system, prompt)
    hit = _complete(system, prompt)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for width, scheme in ((1280, "light"), (1920, "dark")):
        page = login("admin", width=width, height=1000, color_scheme=scheme)
        for name, path in PAGES.items():
            page.goto(system.base + path)
            if name not in ("blocks", "requests"):
                live(page)
            unlabelled = page.evaluate("""
                [...document.querySelectorAll('input:not([type=hidden]), select, textarea, button')]
                .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                              && !el.textContent.trim())
                .map(el => el.outerHTML.slice(0, 80))""")
            assert unlabelled == [], (name, unlabelled)
            wide = page.evaluate("""[...document.querySelectorAll('body *')]
                .filter(el => el.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
                .map(el => el.tagName + (el.id ? '#' + el.id : '') + '.' + el.className).slice(0, 8)""")
            assert wide == [], f"{name} scrolls sideways at {width} px: {wide}"
            if name == "blocks":
                page.locator("#block-table tbody tr[data-block]").first.wait_for()
                page.locator("#block-table tbody tr[data-block] button").first.click()
                page.locator("#placements tbody tr").first.wait_for()
            if name == "requests":
                page.locator("#request-table tbody tr[data-request] button").first.click()
                page.locator("#layers tbody tr td.num").first.wait_for()
                assert "from cache" in page.locator("#tier-split").inner_text()
            page.screenshot(path=str(screenshots / f"{name}-{width}-{scheme}.png"), full_page=True)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == ("rgb(255, 255, 255)" if scheme == "light" else "rgb(13, 17, 23)")
    # The toggle switches theme by keyboard, and the choice is kept.
    page.goto(system.base + "/")
    page.get_by_role("button", name="Light theme").focus()
    page.keyboard.press("Enter")
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    page.reload()
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"


@pytest.mark.parametrize(
    "path,operation",
    [("/api/docs/", ".opblock"), ("/api/redoc/", '[id^="tag/"][id*="/operation/"]')],
)
def test_the_api_docs_load_with_no_other_host_reachable(system, login, screenshots, path, operation):
    page = login("viewer")
    local = system.base.split("//", 1)[1].split("/", 1)[0]
    refused: list[str] = []

    def only_local(route: Any) -> None:
        url = route.request.url
        if url.startswith(("data:", "blob:")) or url.split("//", 1)[-1].split("/", 1)[0] == local:
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    page.route("**/*", only_local)
    page.goto(system.base + path)
    operations = page.locator(operation)
    operations.first.wait_for()
    assert operations.count() > 20  # every operation of the schema is listed
    assert refused == []
    page.screenshot(path=str(screenshots / f"api-{path.strip('/').replace('/', '-')}.png"))
