"""A Content-Security-Policy on every page, and no page that the policy would break: each script
is a file from this server, none inline, no inline event handler, no javascript: URL."""

import uuid
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client

from controlplane.settings.security import CONTENT_SECURITY_POLICY

DASHBOARD = ["/", "/nodes/", "/blocks/", "/requests/", "/policies/", "/movements/"]
OTHERS = ["/accounts/login/", "/admin/", "/admin/auth/user/", "/admin/auth/user/add/"]
EXECUTABLE = {"", "text/javascript", "application/javascript", "module"}


class Scripts(HTMLParser):
    """What the policy (script-src 'self', no 'unsafe-inline') would block, and the scripts loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.blocked: list[str] = []
        self._inline: str | None = None

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.blocked.append(f"<{tag} {name}=...>")
            if name in ("href", "src", "action", "formaction") and (value or "").strip().lower().startswith(
                "javascript:"
            ):
                self.blocked.append(f"<{tag} {name}={value}>")
        if tag == "script":
            if values.get("src"):
                self.sources.append(values["src"])
            elif (values.get("type") or "").lower() in EXECUTABLE:
                self._inline = ""

    def handle_data(self, data):
        if self._inline is not None:
            self._inline += data

    def handle_endtag(self, tag):
        if tag == "script" and self._inline is not None:
            self.blocked.append(f"<script>{self._inline.strip()[:60]}</script>")
            self._inline = None


def parsed(response) -> Scripts:
    scripts = Scripts()
    scripts.feed(response.content.decode())
    return scripts


@pytest.fixture
def admin_client(db):
    user = User.objects.create_user(username="csp-admin", password="pw-12345678", is_staff=True, is_superuser=True)
    user.groups.add(Group.objects.get_or_create(name="admin")[0])
    client = Client()
    client.force_login(user)
    return client


def test_the_policy_allows_no_inline_script_and_the_live_stream():
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["script-src"] == "'self'"
    assert "ws:" in directives["connect-src"] and "wss:" in directives["connect-src"]
    assert directives["frame-ancestors"] == "'none'" and directives["object-src"] == "'none'"


@pytest.mark.django_db
@pytest.mark.parametrize("path", DASHBOARD + OTHERS)
def test_every_page_carries_the_policy_and_nothing_it_would_block(admin_client, path):
    response = admin_client.get(path)
    assert response.status_code == 200, path
    assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    scripts = parsed(response)
    assert scripts.blocked == [], scripts.blocked
    # 'self': every script comes from this server (uPlot too, from /static), none from a CDN.
    assert all(src.startswith("/") and not src.startswith("//") for src in scripts.sources), scripts.sources
    if path in DASHBOARD:
        assert "/static/vendor/uplot/uPlot.iife.min.js" in scripts.sources


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/", "/", "/nodes/"])
def test_logged_out_pages_and_redirects_carry_it_too(client, path):
    response = client.get(path)
    assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    if response.status_code == 200:
        assert parsed(response).blocked == []


@pytest.mark.django_db
def test_a_throttled_login_page_carries_it(client, settings):
    settings.STRATA_LOGIN_FAILURES = 1
    b = uuid.uuid4().bytes
    form = {"username": f"nobody-{b.hex()[:8]}", "password": "wrong"}
    ip = f"10.{b[0]}.{b[1]}.{b[2] or 1}"
    assert client.post("/accounts/login/", form, REMOTE_ADDR=ip).status_code == 200
    response = client.post("/accounts/login/", form, REMOTE_ADDR=ip)
    assert response.status_code == 429
    assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert parsed(response).blocked == []


@pytest.mark.django_db
def test_the_api_docs_keep_their_own_policy(admin_client):
    from controlplane.docs import DOCS_CSP

    assert admin_client.get("/api/docs/")["Content-Security-Policy"] == DOCS_CSP


def test_the_checker_finds_what_the_policy_blocks():
    scripts = Scripts()
    scripts.feed(
        '<script src="/static/a.js"></script><script>alert(1)</script><script type="application/json">{}</script>'
        '<button onclick="go()">x</button><a href="javascript:go()">y</a>'
    )
    assert scripts.sources == ["/static/a.js"]
    assert scripts.blocked == ["<script>alert(1)</script>", "<button onclick=...>", "<a href=javascript:go()>"]
