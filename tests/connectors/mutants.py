"""Connectors for the differential test (vLLM loads them by kv_connector_module_path
"tests.connectors.mutants"): StrataConnector with a fault a test can ask for, and copies of it with
one of the fixes that keep its KV exact turned off, to show that the differential test fails
without each of them. The patches apply to the processes of the engine that loads the class only.

    FaultyStrataConnector   every fix on; a request with kv_transfer_params strata_test_fault="save"
                            cannot have its blocks saved (as when its namespace is removed mid-flight)
    LoraKeyingOff           keys ignore the LoRA adapter
    SaltKeyingOff           keys ignore the cache salt
    ContentIdentityOff      the model's revision is its files' names, sizes and times, not their content
    L3VerificationOff       remote blocks are checked against their own checksums only
    OneRankFails            every fix on; under tensor parallel, the last rank's reads of the blocks
                            named in STRATA_TEST_FAIL_KEYS fail as a corrupt copy does (the other
                            ranks read them whole)
    ShardingOff             under tensor parallel, every rank loads and saves the first rank's heads
    StagesOff               under pipeline parallel, every stage loads the first stage's layers of a
                            block into its own
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from worker.dataplane.connectors import staging
from worker.dataplane.connectors.vllm import connector as connector_module
from worker.dataplane.connectors.vllm import lookups, sharding
from worker.dataplane.connectors.vllm.requests import scope_of
from worker.dataplane.errors import BlockCorrupt
from worker.dataplane.models.checkpoints import WEIGHT_SUFFIXES
from worker.dataplane.offload import OffloadManager
from worker.vllm_connector import StrataConnector

FAULT_PARAM = "strata_test_fault"


def _fail_marked_saves(half: Any) -> None:
    planned = half._fingerprints

    def fingerprints(tracked: Any, blocks: int) -> Any:
        params = tracked.request.kv_transfer_params or {}
        if params.get(FAULT_PARAM) == "save":
            raise ValueError("namespace: no namespace named 'removed-mid-flight'")
        return planned(tracked, blocks)

    half._fingerprints = fingerprints


class FaultyStrataConnector(StrataConnector):
    """StrataConnector with every fix on, and saves that fail for requests marked to fail."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.patch()
        super().__init__(*args, **kwargs)
        if self.scheduler is not None:
            _fail_marked_saves(self.scheduler)

    def patch(self) -> None:
        """Turn a fix off (in this engine's processes) before the connector opens."""


class LoraKeyingOff(FaultyStrataConnector):
    def patch(self) -> None:
        def without_adapter(request: Any, adapters: Any, *, wait: bool) -> Any:
            scope = scope_of(request, adapters, wait=wait)
            return None if scope is None else dataclasses.replace(scope, adapter="")

        lookups.scope_of = without_adapter  # type: ignore[attr-defined]


class SaltKeyingOff(FaultyStrataConnector):
    def patch(self) -> None:
        def without_salt(request: Any, adapters: Any, *, wait: bool) -> Any:
            scope = scope_of(request, adapters, wait=wait)
            return None if scope is None else dataclasses.replace(scope, salt="")

        lookups.scope_of = without_salt  # type: ignore[attr-defined]


def metadata_revision(path: Path) -> str:
    """A checkpoint's identity from its config and its weight files' names, sizes and modification
    times (what two checkpoints built reproducibly share whatever their weights)."""
    digest = hashlib.blake2b(digest_size=16, person=b"strata-ckpt")
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        stat = weights.stat()
        digest.update(f"\0{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return f"local-{digest.hexdigest()}"


class ContentIdentityOff(FaultyStrataConnector):
    def patch(self) -> None:
        profile_for = connector_module.profile_for

        def by_metadata(vllm_config: Any, config: Any) -> Any:
            profile = profile_for(vllm_config, config)
            return dataclasses.replace(profile, revision=metadata_revision(Path(vllm_config.model_config.model)))

        connector_module.profile_for = by_metadata  # type: ignore[attr-defined]


class L3VerificationOff(FaultyStrataConnector):
    """Blocks read from L3 are checked against the checksums their own values carry, not against
    the directory's (the worker half's loads do not verify remote copies)."""

    def patch(self) -> None:
        OffloadManager.verifies_remote = property(lambda self: False)  # type: ignore[assignment,method-assign]


FAIL_KEYS = "STRATA_TEST_FAIL_KEYS"


class OneRankFails(FaultyStrataConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        worker = self.worker
        if worker is None or worker.shard.rank != worker.shard.ranks - 1 or worker.shard.whole:
            return
        failing = {uuid.UUID(key) for key in os.environ.get(FAIL_KEYS, "").split(",") if key}
        store = self.runtime.store
        read = store.get_layers

        def get_layers(keys: Any, **kwargs: Any) -> list[Future[Any]]:
            futures = read(keys, **kwargs)
            for i, key in enumerate(keys):
                if key in failing:
                    futures[i].exception()  # the read lands, then its copy does not verify
                    failed: Future[Any] = Future()
                    failed.set_exception(BlockCorrupt(key, tier="host", reason="checksum mismatch on this rank"))
                    futures[i] = failed
            return futures

        store.get_layers = get_layers  # type: ignore[method-assign]


class ShardingOff(FaultyStrataConnector):
    def patch(self) -> None:
        sharding.Shard.first = property(lambda self: 0)  # type: ignore[assignment,method-assign]


class StagesOff(FaultyStrataConnector):
    def patch(self) -> None:
        read = staging.StagedLoads._read

        def first_stage_s(self: staging.StagedLoads, piece: staging.Piece, slot: int) -> Any:
            return read(self, dataclasses.replace(piece, layer=piece.layer - self.layers[0]), slot)

        staging.StagedLoads._read = first_stage_s  # type: ignore[method-assign]
