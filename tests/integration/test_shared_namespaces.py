"""A shared namespace reused from other namespaces through a real node: its blocks lead a tenant's
prompt, the tenant's own blocks chain on from them, a private namespace's never match, and a
namespace no longer shared stops matching."""

import openai
import pytest

from controlplane.directory.models import Block, Namespace
from controlplane.directory.services.catalog import namespace_create, namespace_update
from tests.support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

BLOCK = 16  # STRATA_BLOCK_TOKENS of the serving node
DOCUMENT = [(7 * i + 3) % 500 + 1 for i in range(5 * BLOCK)]  # five full blocks
QUESTIONS = {name: [(11 * i + seed) % 500 + 1 for i in range(20)] for name, seed in (("q1", 5), ("q2", 9), ("q3", 13))}


def test_a_shared_namespace_is_reused_from_other_namespaces(serving_node):
    _, port = serving_node
    for name, shared in (("library", True), ("tenant-a", False), ("tenant-b", False), ("tenant-c", False)):
        namespace_create(name=name, shared=shared)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=120)
    wait_for(lambda: _answers(client), what="the node server")

    def ask(namespace: str, question: str):  # noqa: ANN202
        return client.completions.create(
            model="tiny",
            prompt=DOCUMENT + QUESTIONS[question],
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Strata-Namespace": namespace},
        )

    # tenant-b's private copy of the document and question 2: the answer without any reuse.
    private = ask("tenant-b", "q2")
    assert private.usage.prompt_tokens_details.cached_tokens == 0
    wait_for(lambda: Block.objects.filter(namespace__name="tenant-b").count() >= 6, what="tenant-b's blocks")

    # The library stores the document (with its own question after it).
    ask("library", "q1")
    wait_for(lambda: Block.objects.filter(namespace__name="library").count() >= 6, what="the library's blocks")

    # tenant-a asks question 2 over the document: the document's five blocks come from the
    # library, none from tenant-b (whose six would all match the prompt), and the greedy answer
    # is the one computed without reuse.
    first = ask("tenant-a", "q2")
    assert first.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    assert first.choices[0].text == private.choices[0].text
    # Its own sixth block chains on from the library's: the next ask reuses all six, and the
    # library's blocks were not copied into tenant-a's namespace.
    wait_for(lambda: Block.objects.filter(namespace__name="tenant-a").count() == 1, what="tenant-a's own block")
    again = ask("tenant-a", "q2")
    assert again.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
    assert again.choices[0].text == private.choices[0].text
    assert Block.objects.filter(namespace__name="library").count() == 6

    # The library stops being shared: within the node's refresh, tenant-c's ask reuses nothing.
    namespace_update(namespace=Namespace.objects.get(name="library"), shared=False)
    fresh = wait_for(
        lambda: (answer := ask("tenant-c", "q1")).usage.prompt_tokens_details.cached_tokens == 0 and answer,
        timeout=30,
        what="the library no longer matching",
    )
    assert fresh.choices[0].text


def _answers(client) -> bool:  # noqa: ANN001
    try:
        return bool(client.models.list().data)
    except openai.APIConnectionError:
        return False
