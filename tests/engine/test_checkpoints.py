"""A model's identity: a local checkpoint's revision is a digest of its content (kept, and computed
again when a file changes), and a hub id resolves through the local hub cache, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.dataplane.models import checkpoints
from worker.dataplane.models.checkpoints import REVISION_FILE, checkpoint_revision, identity_files
from worker.dataplane.models.loading import checkpoint_profile, load_model, save_preset
from worker.dataplane.profile import model_key

BLOCK = 16
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's cache directory of the test (nothing is kept under the user's home)."""
    path = tmp_path / "node-cache"
    monkeypatch.setenv("STRATA_CACHE_DIR", str(path))
    return path


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written a moment ago count as long settled (a checkpoint that has lain a while), so
    a digest kept for them is used; see `test_a_digest_of_files_changed_within_a_tick_is_not_used`."""
    monkeypatch.setattr(checkpoints, "RACY_NS", 0)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two saved `tiny` presets, seed 0 and seed 1, each as the original of a test's copies."""
    root = tmp_path_factory.mktemp("originals")
    return save_preset("tiny", root / "seed0", seed=0), save_preset("tiny", root / "seed1", seed=1)


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(REVISION_FILE))
    return target


def profile(path: Path | str, **kwargs: object) -> object:
    return checkpoint_profile(path, block_tokens=BLOCK, **kwargs)  # type: ignore[arg-type]


def stamps_of(path: Path) -> dict[str, tuple[int, int]]:
    """What a metadata identity would see: each hashed file's size and mtime."""
    return {name: ((path / name).stat().st_size, (path / name).stat().st_mtime_ns) for name in identity_files(path)}


def test_checkpoints_that_differ_only_in_their_weights_get_different_revisions_and_keys(tmp_path, cache_dir, tiny_pair):
    # A fine-tune with reproducible-build mtimes: same directory name, file names, sizes and mtimes.
    a = copy_checkpoint(tiny_pair[0], tmp_path / "a" / "ckpt")
    b = copy_checkpoint(tiny_pair[1], tmp_path / "b" / "ckpt")
    for name in os.listdir(a):
        stat = (a / name).stat()
        os.utime(b / name, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert stamps_of(a) == stamps_of(b)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()

    first, second = profile(a), profile(b)
    assert first.model_id == second.model_id == "ckpt"
    assert first.revision.startswith("content-") and second.revision.startswith("content-")
    assert first.revision != second.revision
    assert model_key(first) != model_key(second)
    # The engine that loads the weights names them alike.
    assert load_model(str(b), device="cpu").profile(BLOCK) == second


def test_the_same_files_elsewhere_get_the_same_revision(tmp_path, cache_dir, tiny_pair):
    # Nodes on other machines, or another copy on one machine, agree on the model key.
    here = copy_checkpoint(tiny_pair[0], tmp_path / "node-1" / "ckpt")
    revision = checkpoint_revision(here)
    there = tmp_path / "node-2" / "ckpt"
    shutil.copytree(here, there)  # the kept digest travels with it, naming the first path
    assert json.loads((there / REVISION_FILE).read_text())["path"] == str(here)
    assert checkpoint_revision(there) == revision
    assert model_key(profile(there)) == model_key(profile(here))
    # The copy's digest was computed again for its own path, and kept there.
    assert json.loads((there / REVISION_FILE).read_text())["path"] == str(there)


@pytest.mark.parametrize("age", ["settled", "racy"])
def test_a_weight_file_written_again_with_its_old_size_and_mtime_gets_a_new_revision(
    tmp_path, cache_dir, tiny_pair, monkeypatch, age
):
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    before = checkpoint_revision(path)
    if age == "settled":
        # The kept digest would be used: only the ctime of the file written again tells it apart.
        monkeypatch.setattr(checkpoints, "RACY_NS", 0)
        time.sleep(0.05)  # past the filesystem's timestamp tick
    weights = path / "model.safetensors"
    stat = weights.stat()
    replacement = (tiny_pair[1] / "model.safetensors").read_bytes()
    assert len(replacement) == stat.st_size
    with open(weights, "r+b") as out:  # in place: the inode stays
        out.write(replacement)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns, weights.stat().st_ino) == (
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ino,
    )
    after = checkpoint_revision(path)
    assert after != before
    # The digest is of the content: these are seed 1's files now.
    assert after == checkpoint_revision(copy_checkpoint(tiny_pair[1], tmp_path / "other" / "ckpt"))


def test_the_kept_digest_is_used_without_reading_the_weights(tmp_path, cache_dir, tiny_pair, monkeypatch, settled):
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    revision = checkpoint_revision(path)
    kept = json.loads((path / REVISION_FILE).read_text())
    assert kept["revision"] == revision and kept["path"] == str(path)
    assert [stamp[0] for stamp in kept["files"]] == ["config.json", "model.safetensors"]

    def no_reading(*args: object) -> bytes:
        raise AssertionError("the weights were read again")

    monkeypatch.setattr(checkpoints, "_hash_segment", no_reading)
    assert checkpoint_revision(path) == revision
    assert profile(path).revision == revision


def test_a_digest_of_files_changed_within_a_tick_is_not_used(tmp_path, cache_dir, tiny_pair, monkeypatch):
    # A file written again within its ctime's tick could keep its whole stamp: such a record
    # (files changed under RACY_NS before they were stamped) is computed again.
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    revision = checkpoint_revision(path)
    reads = []
    hash_segment = checkpoints._hash_segment
    monkeypatch.setattr(checkpoints, "_hash_segment", lambda *args: reads.append(args) or hash_segment(*args))
    assert checkpoint_revision(path) == revision and reads
    kept = json.loads((path / REVISION_FILE).read_text())
    assert all(kept["stamped_ns"] - stamp[3] < checkpoints.RACY_NS for stamp in kept["files"])
    # The same record, its files by then settled, is used.
    monkeypatch.setattr(checkpoints, "RACY_NS", 0)
    reads.clear()
    assert checkpoint_revision(path) == revision and not reads


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda kept: kept["files"][1].__setitem__(3, kept["files"][1][3] - 1), id="another-ctime"),
        pytest.param(lambda kept: kept["files"][1].__setitem__(4, kept["files"][1][4] + 1), id="another-inode"),
        pytest.param(lambda kept: kept["files"].pop(), id="a-file-left-out"),
        pytest.param(lambda kept: kept.__setitem__("path", "/elsewhere/ckpt"), id="another-path"),
        pytest.param(lambda kept: kept.__setitem__("format", 0), id="another-format"),
        pytest.param(lambda kept: kept.pop("stamped_ns"), id="no-stamp-time"),
        pytest.param(lambda kept: kept.__setitem__("revision", "local-x"), id="not-a-digest"),
    ],
)
def test_a_kept_digest_that_does_not_match_is_computed_again(tmp_path, cache_dir, tiny_pair, settled, tamper):
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    revision = checkpoint_revision(path)
    kept = json.loads((path / REVISION_FILE).read_text())
    kept["revision"] = "content-" + "0" * 32  # what a stale record would claim
    (path / REVISION_FILE).write_text(json.dumps(kept))
    assert checkpoint_revision(path) == kept["revision"]  # untampered, the record is believed
    tamper(kept)
    (path / REVISION_FILE).write_text(json.dumps(kept))
    assert checkpoint_revision(path) == revision
    assert json.loads((path / REVISION_FILE).read_text())["revision"] == revision  # and kept again


@pytest.mark.parametrize("content", [b"{not json", b"", b"[]", b"\xff\xfe", b'{"format": 1}'])
def test_a_malformed_kept_digest_is_computed_again(tmp_path, cache_dir, tiny_pair, settled, content):
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    revision = checkpoint_revision(path)
    (path / REVISION_FILE).write_bytes(content)
    assert checkpoint_revision(path) == revision
    assert json.loads((path / REVISION_FILE).read_text())["revision"] == revision


@pytest.fixture
def read_only() -> Iterator[object]:
    """Make a directory read-only for this process, root included (chattr +i), and undo it."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.chmod(0o555)
        made.append(path)
        if os.access(path, os.W_OK):  # root: permissions do not stop it
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode:
                pytest.skip("this machine cannot make a directory read-only for root")
        return path

    yield make
    for path in made:
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(path)], stderr=subprocess.DEVNULL)
        path.chmod(0o755)


def test_a_read_only_checkpoint_keeps_its_digest_in_the_cache_dir(
    tmp_path, cache_dir, tiny_pair, read_only, settled, monkeypatch
):
    path = read_only(copy_checkpoint(tiny_pair[0], tmp_path / "ckpt"))
    revision = checkpoint_revision(path)
    assert not (path / REVISION_FILE).exists()
    kept = list((cache_dir / "revisions").iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text())["path"] == str(path)
    assert revision == checkpoint_revision(copy_checkpoint(tiny_pair[0], tmp_path / "writable" / "ckpt"))
    monkeypatch.setattr(checkpoints, "_hash_segment", None)  # the kept one: nothing is read
    assert profile(path).revision == revision
    monkeypatch.undo()
    # An explicit cache_dir (the node's option) is used over the variable.
    monkeypatch.setenv("STRATA_CACHE_DIR", str(cache_dir))
    assert checkpoint_revision(path, cache_dir=tmp_path / "option") == revision
    assert len(list((tmp_path / "option" / "revisions").iterdir())) == 1


def test_a_digest_that_cannot_be_kept_is_a_log_line(tmp_path, monkeypatch, tiny_pair, read_only, caplog):
    (tmp_path / "no-cache").mkdir()
    monkeypatch.setenv("STRATA_CACHE_DIR", str(read_only(tmp_path / "no-cache")))
    path = read_only(copy_checkpoint(tiny_pair[0], tmp_path / "ckpt"))
    with caplog.at_level("WARNING", logger="strata.engine"):
        revision = checkpoint_revision(path)
    assert revision == checkpoint_revision(copy_checkpoint(tiny_pair[0], tmp_path / "writable" / "ckpt"))
    assert "could not be kept" in caplog.text


def test_bad_checkpoints_are_refused_by_name(tmp_path, cache_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty is not a checkpoint directory \(a directory without config.json\)"):
        profile(tmp_path / "empty")
    with pytest.raises(ValueError, match="without config.json"):
        checkpoint_revision(tmp_path / "empty")
    with pytest.raises(ValueError, match="'no-such-model' is neither a preset .* nor a local directory nor a hub"):
        profile("no-such-model")


def test_a_large_checkpoint_says_what_it_hashes_and_how_long_it_took(
    tmp_path, cache_dir, tiny_pair, monkeypatch, caplog, settled
):
    path = copy_checkpoint(tiny_pair[0], tmp_path / "ckpt")
    whole = checkpoint_revision(path)
    (path / REVISION_FILE).unlink()
    monkeypatch.setattr(checkpoints, "LARGE_BYTES", 1)
    monkeypatch.setattr(checkpoints, "SEGMENT_BYTES", 4096)  # many segments, on parallel threads
    with caplog.at_level("INFO", logger="strata.engine"):
        segmented = checkpoint_revision(path)
        checkpoint_revision(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "strata.engine"]
    assert lines[0] == f"model ckpt: computing its content digest (0.0 GB, once; kept in {path / REVISION_FILE})"
    assert lines[1].startswith(f"model ckpt: content digest {segmented} in ")
    assert len(lines) == 2  # once
    assert segmented != whole  # the segment size is part of the digest's definition


# -- hub ids ---------------------------------------------------------------------------------------


def hub_cache(root: Path, source: Path, *, repo: str = "org/tiny", commit: str = COMMIT, ref: str = "main") -> Path:
    """A hub cache holding `source` as snapshot `commit` of `repo`, laid out as huggingface_hub
    keeps it (blobs, snapshot links, refs)."""
    storage = root / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.name == REVISION_FILE:
            continue
        blob = storage / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_a_hub_id_resolves_through_the_hub_cache_offline(tmp_path, cache_dir, tiny_pair, monkeypatch, offline):
    snapshot = hub_cache(tmp_path / "hub", tiny_pair[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = profile("org/tiny")
    assert (hub.model_id, hub.revision) == ("org--tiny", COMMIT)  # the commit; nothing hashed
    assert not (snapshot / REVISION_FILE).exists() and not cache_dir.exists()
    # The snapshot's directory given by path (as the node hands it to vLLM) is the same model.
    assert profile(snapshot) == hub
    loaded = load_model("org/tiny", device="cpu")
    assert (loaded.name, loaded.revision) == ("org--tiny", COMMIT)
    assert loaded.profile(BLOCK) == hub
    # The same weights as a plain local directory are another model (named by content).
    local = profile(copy_checkpoint(tiny_pair[0], tmp_path / "local" / "ckpt"))
    assert local.revision.startswith("content-") and model_key(local) != model_key(hub)


def test_a_hub_id_honours_hf_home_and_a_revision(tmp_path, cache_dir, tiny_pair, monkeypatch, offline):
    hub_cache(tmp_path / "home" / "hub", tiny_pair[0])
    hub_cache(tmp_path / "home" / "hub", tiny_pair[1], commit=OTHER_COMMIT, ref="v2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert profile("org/tiny").revision == COMMIT
    assert profile("org/tiny", revision="v2").revision == OTHER_COMMIT
    assert profile("org/tiny", revision=OTHER_COMMIT).revision == OTHER_COMMIT
    assert model_key(profile("org/tiny")) != model_key(profile("org/tiny", revision="v2"))


def test_a_hub_id_absent_from_the_cache_says_where_it_looked_and_what_to_do(tmp_path, cache_dir, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as raised:
        profile("org/absent")
    message = str(raised.value)
    assert message.startswith("model: org/absent is not in the Hugging Face hub cache")
    assert str(tmp_path / "hub") in message and "hf download org/absent" in message and "local" in message
    with pytest.raises(ValueError, match="org/absent at revision v9 is not in the Hugging Face hub cache"):
        profile("org/absent", revision="v9")
    with pytest.raises(ValueError, match="org/absent is not in the Hugging Face hub cache"):
        load_model("org/absent", device="cpu")


def test_a_hub_snapshot_without_config_is_refused(tmp_path, cache_dir, tiny_pair, monkeypatch, offline):
    snapshot = hub_cache(tmp_path / "hub", tiny_pair[0])
    (snapshot / "config.json").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"hub snapshot of org/tiny at .* has no config.json"):
        profile("org/tiny")


@pytest.mark.django_db
def test_a_hub_model_registers_in_the_directory(tmp_path, cache_dir, tiny_pair, monkeypatch, offline):
    from controlplane.directory.services import modelprofile_ensure

    hub_cache(tmp_path / "hub", tiny_pair[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = profile("org/tiny")
    row = modelprofile_ensure(profile=hub)
    assert (row.model_id, row.revision, row.model_key) == ("org--tiny", COMMIT, model_key(hub))
    assert row.name.startswith("org-tiny-")
