"""The placement file: a round trip, atomic writes (a crash mid-write leaves the previous file),
every unreadable file refused by name, identity checks naming each field, the background writer,
a directory or a link another user controls refused by name before anything is written."""

import json
import logging
import multiprocessing
import os
import stat

import pytest
import torch

from eplb_graph.core import placement_file, private_files
from eplb_graph.core.placement_file import (
    PlacementFileError,
    PlacementIdentity,
    PlacementRecord,
    PlacementWriter,
    check_fits,
    check_writable,
    config_hash,
    load,
    save,
)

IDENTITY = PlacementIdentity("Qwen3MoeForCausalLM", "abc", 2, 4, 6, 2, "none")


def record(shift: int = 0, window: bool = True) -> PlacementRecord:
    placements = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]]).roll(shift, dims=1)
    load_window = torch.tensor([[5.0, 1, 1, 1], [1, 1, 2, 7]]) if window else None
    return PlacementRecord(IDENTITY, placements, load_window, 3, "vllm")


def test_a_saved_record_loads_back_equal(tmp_path):
    path = tmp_path / "placement.json"
    save(path, record())
    loaded = load(path)
    assert loaded.identity == IDENTITY and loaded.rearrangements == 3 and loaded.written_by == "vllm"
    assert torch.equal(loaded.physical_to_logical, record().physical_to_logical)
    assert torch.equal(loaded.load_window, record().load_window.double())
    save(path, record(window=False))
    assert load(path).load_window is None
    assert [p.name for p in tmp_path.iterdir()] == ["placement.json"]  # no temporary file left behind


def crash_while_writing(path: str, where: str) -> None:
    """A writer process that dies mid-write (before the rename, or with the data half flushed)."""
    if where == "rename":
        os.replace = lambda *args: os._exit(9)
    else:
        write = os.write

        def write_half(descriptor, data):
            write(descriptor, bytes(data)[:40])
            os._exit(9)

        os.write = write_half
    save(path, record(shift=1))


@pytest.mark.launches  # a writer process
@pytest.mark.parametrize("where", ["rename", "write"])
def test_a_crash_mid_write_leaves_the_previous_file_intact(tmp_path, where):
    path = tmp_path / "placement.json"
    save(path, record())
    writer = multiprocessing.get_context("fork").Process(target=crash_while_writing, args=(str(path), where))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 9
    assert torch.equal(load(path).physical_to_logical, record().physical_to_logical)


def rewrite(path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(format="something else"), "is not an eplb-graph placement file"),
    (lambda d: d.update(version=2), "has version 2; this eplb-graph reads version 1"),
    (lambda d: d["physical_to_logical"][0].__setitem__(0, 3), "is corrupt: its checksum does not match its content"),
    (lambda d: d.update(checksum="sha256:0"), "is corrupt"),
])
def test_a_file_that_is_not_a_good_placement_file_is_refused_by_name(tmp_path, change, message):
    path = tmp_path / "placement.json"
    save(path, record())
    rewrite(path, change)
    with pytest.raises(PlacementFileError, match=message):
        load(path)


def test_a_truncated_or_missing_file_cannot_be_read(tmp_path):
    path = tmp_path / "placement.json"
    with pytest.raises(PlacementFileError, match="cannot be read"):
        load(path)
    save(path, record())
    path.write_text(path.read_text()[:-30])
    with pytest.raises(PlacementFileError, match="cannot be read"):
        load(path)


def test_a_placement_that_breaks_its_own_identity_is_refused_even_with_a_good_checksum(tmp_path):
    bad = PlacementRecord(IDENTITY, torch.tensor([[0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 0, 1]]), None, 0, "vllm")
    path = tmp_path / "placement.json"
    save(path, bad)
    with pytest.raises(PlacementFileError, match=r"layer 0: logical experts \[1, 2, 3\] have no replica"):
        load(path)
    save(path, PlacementRecord(IDENTITY, torch.zeros(3, 6, dtype=torch.int64), None, 0, "vllm"))
    with pytest.raises(PlacementFileError, match=r"has shape \(3, 6\), its identity says"):
        load(path)


def test_check_fits_names_every_field_that_differs_and_skips_unknown_ones():
    here = PlacementIdentity("Qwen3MoeForCausalLM", "def", None, 4, 8, 4, "none")
    with pytest.raises(PlacementFileError) as refused:
        check_fits(record(), here, "p.json")
    message = str(refused.value)
    assert "config_hash is 'abc' in the file, 'def' here" in message
    assert "num_physical_experts is 6 in the file, 8 here" in message and "ep_size is 2 in the file, 4 here" in message
    assert "num_layers" not in message and "architecture" not in message
    check_fits(record(), PlacementIdentity(None, None, None, None, None, 2, "none"), "p.json")


def test_config_hash_leaves_out_the_checkpoint_path_and_transformers_version():
    base = {"num_experts": 8, "hidden_size": 64}
    assert config_hash({**base, "_name_or_path": "/a", "transformers_version": "5"}) == config_hash(base)
    assert config_hash({**base, "num_experts": 16}) != config_hash(base)


def test_an_unwritable_directory_is_refused_at_start(tmp_path):
    with pytest.raises(PlacementFileError, match="does not exist"):
        check_writable(tmp_path / "missing" / "placement.json")
    check_writable(tmp_path / "placement.json")


def test_the_writer_writes_the_latest_record_and_never_raises_into_serving(tmp_path, caplog):
    path = tmp_path / "placement.json"
    writer = PlacementWriter(path)
    for shift in range(5):
        writer.submit(record(shift))
    assert writer.flush()
    assert torch.equal(load(path).physical_to_logical, record(4).physical_to_logical)
    writer.close()
    assert 1 <= writer.writes <= 5 and writer.error is None
    assert torch.equal(load(path).physical_to_logical, record(4).physical_to_logical)  # the latest wins
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(record())

    failing = PlacementWriter(tmp_path / "gone" / "placement.json")
    with caplog.at_level(logging.WARNING, logger=placement_file.__name__):
        failing.submit(record())
        failing.close()
    assert isinstance(failing.error, OSError) and "could not write the placement file" in caplog.text


OTHER_UID = 65534  # nobody: "another user" of this machine


def foreign(path) -> None:
    """``path`` (a link or a directory) now belongs to another user, as if that user had made it."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.lchown(path, OTHER_UID, OTHER_UID)


def test_a_directory_other_users_can_write_is_refused_by_name_and_the_file_left_untouched(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "placement.json"
    save(path, record())
    before = path.read_bytes()
    shared.chmod(0o777)  # not sticky: anyone may rename their own file over ours
    with pytest.raises(PlacementFileError, match=rf"directory {shared} can be written by other users .*nothing written"):
        save(path, record(shift=1))
    with pytest.raises(PlacementFileError, match=rf"directory {shared} can be written by other users"):
        check_writable(path)
    assert path.read_bytes() == before and sorted(p.name for p in shared.iterdir()) == ["placement.json"]
    shared.chmod(0o775)  # the group's other members too
    with pytest.raises(PlacementFileError, match="can be written by other users"):
        save(path, record(shift=1))
    assert path.read_bytes() == before


def test_a_sticky_directory_of_ours_is_accepted_and_one_of_another_user_is_refused(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: each user can replace only their own entries
    path = sticky / "placement.json"
    save(path, record())
    check_writable(path)
    assert torch.equal(load(path).physical_to_logical, record().physical_to_logical)
    assert stat.S_IMODE(path.stat().st_mode) == private_files._default_mode()  # 0o600 only while written
    foreign(sticky)
    with pytest.raises(PlacementFileError, match=rf"directory {sticky} is owned by uid {OTHER_UID}"):
        save(path, record(shift=1))
    assert torch.equal(load(path).physical_to_logical, record().physical_to_logical)


def test_a_link_planted_by_another_user_is_refused_and_its_target_untouched(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("a file the server may replace")
    path = sticky / "placement.json"
    path.symlink_to(victim)
    foreign(path)
    with pytest.raises(PlacementFileError, match=rf"{path} is a symbolic link owned by uid {OTHER_UID}.*nothing written"):
        save(path, record())
    with pytest.raises(PlacementFileError, match="symbolic link owned by uid"):
        check_writable(path)
    with pytest.raises(PlacementFileError, match="symbolic link owned by uid"):
        load(path)
    assert victim.read_text() == "a file the server may replace" and path.is_symlink()


def test_a_link_of_ours_is_followed_and_stays_a_link(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    path = tmp_path / "placement.json"
    path.symlink_to(kept / "placement.json")
    save(path, record())
    assert path.is_symlink() and torch.equal(load(kept / "placement.json").physical_to_logical,
                                             record().physical_to_logical)
    save(path, record(shift=1))
    assert path.is_symlink() and torch.equal(load(path).physical_to_logical, record(shift=1).physical_to_logical)


def test_the_temporary_file_is_new_and_never_a_link(tmp_path, monkeypatch):
    path = tmp_path / "placement.json"
    opened = []
    real_open = os.open

    def recording_open(file, flags, mode=0o777, **kwargs):
        opened.append((str(file), flags, mode))
        return real_open(file, flags, mode, **kwargs)

    monkeypatch.setattr(private_files.os, "open", recording_open)
    save(path, record())
    temporary = [(flags, mode) for file, flags, mode in opened if file.endswith(".tmp")]
    wanted = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    assert len(temporary) == 1 and temporary[0][0] & wanted == wanted and temporary[0][1] == 0o600

    # a link planted at the temporary name is neither followed nor removed
    class Fixed:
        hex = "0" * 32

    monkeypatch.setattr(private_files.uuid, "uuid4", lambda: Fixed)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = tmp_path / f".placement.json.{Fixed.hex}.tmp"
    planted.symlink_to(victim)
    foreign(planted)  # another user's: a stale temporary file of ours would be removed first
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        save(path, record(shift=1))
    assert victim.read_text() == "untouched" and planted.is_symlink() and path.read_bytes() == before
