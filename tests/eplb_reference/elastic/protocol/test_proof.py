"""``protocol/proof.py``: the run secret's seal, and how a secret is read, written and kept out of sight."""

import pytest

from eplb_reference.elastic.protocol import SECRET_ENV, RunSecret
from eplb_reference.elastic.protocol.proof import Unproven


def test_a_seal_opens_under_its_key_with_its_secret_only():
    secret = RunSecret.generate()
    sealed = secret.seal("ep/member/1/fence", "hung")
    assert secret.open("ep/member/1/fence", sealed) == "hung"
    for key, text, other in (("ep/member/2/fence", sealed, secret),  # moved under another key
                             ("ep/member/1/fence", sealed[:-1] + "x", secret),  # tampered
                             ("ep/member/1/fence", sealed, RunSecret.generate()),  # another run's secret
                             ("ep/member/1/fence", "hung", secret),  # never sealed
                             ("ep/member/1/fence", "\u00e9" * 64 + ".hung", secret)):  # not even hex
        with pytest.raises(Unproven, match="without the run's seal"):
            other.open(key, text)


def test_the_secret_never_shows_in_a_repr_and_is_long_enough():
    secret = RunSecret.generate()
    assert repr(secret) == "RunSecret(<hidden>)" and secret.environment()[SECRET_ENV] not in repr(secret)
    with pytest.raises(ValueError, match="32 bytes at least"):
        RunSecret(b"short")
    with pytest.raises(ValueError, match="EPLB_GRAPH_RUN_SECRET: a run secret is 64 hex digits"):
        RunSecret.load(None, {SECRET_ENV: "abc"}, create=False)


def test_serve_writes_a_new_secret_file_of_mode_600_and_join_reads_it(tmp_path):
    path = tmp_path / "run.secret"
    written = RunSecret.load(str(path), {}, create=True)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    read = RunSecret.load(str(path), {}, create=False)
    assert read.open("k", written.seal("k", "v")) == "v"
    assert RunSecret.load(str(path), {}, create=True).open("k", written.seal("k", "v")) == "v"  # serve again: kept
    from_env = RunSecret.load(None, written.environment(), create=False)
    assert from_env.open("k", written.seal("k", "v")) == "v"


def test_a_secret_file_others_can_read_or_a_planted_link_is_refused(tmp_path):
    loose = tmp_path / "loose.secret"
    loose.write_text(RunSecret.generate().environment()[SECRET_ENV])
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="mode 600 .*it has mode 644"):
        RunSecret.load(str(loose), {}, create=False)
    target = tmp_path / "target"
    target.write_text("kept")
    link = tmp_path / "link.secret"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="a symlink is refused"):
        RunSecret.load(str(link), {}, create=False)
    with pytest.raises(ValueError, match="a symlink is refused"):
        RunSecret.load(str(link), {}, create=True)  # serve neither writes through it nor reads it
    assert target.read_text() == "kept"


def test_join_without_any_secret_is_refused_by_name():
    with pytest.raises(ValueError, match="--secret-file PATH .* or EPLB_GRAPH_RUN_SECRET"):
        RunSecret.load(None, {}, create=False)
    assert isinstance(RunSecret.load(None, {}, create=True), RunSecret)  # serve: one in memory
